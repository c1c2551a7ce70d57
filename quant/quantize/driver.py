"""Quantize a model layer by layer: statistics -> algorithm -> codes written, weights replaced, inputs propagated.

The plan arrives as canonical module name -> ``Scheme`` and an algorithm name (``run.stages`` converts the
plan). For each decoder layer: load it (layerwise); let the algorithm (``quantize.algorithms``) drive a ``LayerJob``
over it: calibration passes whose hooks accumulate the statistics it needs (``quantize.gptq_layer``,
``quantize.awq_layer``), then every planned module quantized — experts of one projection and one spec as a single
``[E, out, in]`` problem; write the codes to ``quantized/layer_XXXXX.safetensors``, put the dequantized
weights into the layer and propagate the activations through the *quantized* layer, so later layers calibrate
on what they will see at inference. A layer whose file exists, and still holds the bytes whose SHA-256 was
recorded when it was written, is not recomputed (resume after a crash); a damaged one is.

With several ranks (``lw.world``) each rank owns a contiguous range of a layer's experts, and the layer's other
modules (solved in groups that share an input) go to ranks by estimated solve time (``dist.assign``, longest
first onto the least-loaded rank). Calibration batches run data-parallel and ``quant.parallel.relay`` hands each owner its
experts' routed tokens (and every rank the other modules' inputs) in global batch order, so every Hessian, and
so every code, is the one a single process computes. Owners exchange codes (``World.exchange_tensors``), every
rank puts the dequantized layer together and propagates its own batches; only the writer writes the layer file.
With ``quantize.statistics: reduce`` each rank instead sums its own batches and the sums are all-reduced once a
layer. AWQ: every rank holds every expert's statistics (every batch in order, or its own batches summed over ranks
after each pass), searches and quantizes its own experts (the shared gate/up search's error tables are gathered in
expert order before the pick), and the codes are exchanged as GPTQ's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from quant.calibration import CalibrationSet
from quant.errors import QuantError
from quant.layerwise import Layerwise
from quant.models import ModelSource
from quant.progress import step
from quant.quantize.algorithms import Algorithm, algorithm
from quant.quantize.layer_job import LayerJob
from quant.quantize.qstore import (
    LayerWriter,
    layer_file,
    load_into_layer,
    read_report,
    remove_layer,
    stored_layer_problem,
)
from quant.quantize.results import LayerReport
from quant.recipe import QuantizeSpec
from quant.scheme import Scheme

log = logging.getLogger(__name__)


def quantize_model(source: ModelSource, calib: CalibrationSet, modules: Mapping[str, Scheme], algorithm_name: str,
                   spec: QuantizeSpec, lw: Layerwise, out_dir: Path) -> list[LayerReport]:
    """Quantize the planned modules (``modules``: canonical name -> spec, in the plan's order) with the algorithm
    ``algorithm_name`` into ``out_dir``, one file a layer (existing complete layer files are reused). In a world of
    several ranks (``lw.world``) every rank calls this; only the writer writes ``out_dir``."""
    algo = algorithm(algorithm_name)
    world = lw.world
    if world.is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    hidden = lw.embed(calib.tokens)
    reports = []
    writer = LayerWriter(background=lw.device.type == "cuda")
    log.info("quantize: %d layers, algorithm %s", source.n_layers, algo.name,
             extra=step("quantize", 0, source.n_layers))

    def job_for(idx: int, layer: nn.Module) -> LayerJob:
        return LayerJob(source, idx, layer, modules, spec, world, algo.solve)

    try:
        for idx in range(source.n_layers):
            reports.append(_one_layer(job_for, algo, lw, idx, hidden, out_dir, writer))
            _log_layer(reports[-1], source.n_layers, spec.min_tokens)
            if idx + 1 < source.n_layers:
                world.raise_if_stopped(f"layer {idx} of {source.n_layers}")
    finally:
        writer.wait()  # the layer in hand reaches the disk before any exit
    if world.is_writer:
        (out_dir / "layers.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return reports


def _one_layer(job_for: Callable[[int, nn.Module], LayerJob], algo: Algorithm, lw: Layerwise, idx: int,
               hidden: torch.Tensor, out_dir: Path, writer: LayerWriter) -> LayerReport:
    """Quantize (or reload) layer ``idx`` and propagate ``hidden`` through it in place."""
    world, t0 = lw.world, time.perf_counter()
    with lw.layer(idx) as layer:
        job = job_for(idx, layer)
        job.results.report.load_seconds = time.perf_counter() - t0
        path = layer_file(out_dir, idx)
        if world.broadcast_object(_reusable(path, idx) if world.is_writer else None):
            _apply_stored(job, path, lw.device)
            job.results.report.resumed = True
        else:
            _quantize_layer(job, algo, lw, hidden, path, writer)
        with job.results.timed("forward_seconds", lw.device):
            lw.forward(layer, hidden, out=hidden)
    return job.results.finish(time.perf_counter() - t0)


def _quantize_layer(job: LayerJob, algo: Algorithm, lw: Layerwise, hidden: torch.Tensor, path: Path,
                    writer: LayerWriter) -> None:
    """Compute this layer's codes (this rank's share, then exchanged) and put them into the layer."""
    algo.run_layer(job, lw, hidden)
    job.share()
    res = job.results
    res.codes = {n: res.codes[n] for n in job.modules if n in res.codes}  # plan order: the same file at any size
    if job.world.is_writer:
        writer.submit(path, res.codes, res.params, asdict(res.report))  # the report too: a resumed run shows it


def _apply_stored(job: LayerJob, path: Path, device: torch.device) -> None:
    """Put previously stored dequantized weights (and changed kept parameters) into the layer, and its stored
    report (worst error, fallbacks, repairs, solve times) into ``job.results`` (resume path)."""
    res = job.results
    res.codes, res.params = load_into_layer(job.source, job.layer, job.idx, path, device)
    missing = set(job.modules) - set(res.codes)
    if missing:
        raise QuantError(f"stored layer {job.idx} lacks {sorted(missing)[:3]}; remove it and rerun with "
                         "--force quantize")
    stored = read_report(path)
    keep = ("worst_rel_error", "worst_module", "stats_seconds", "solve_seconds", "rtn_fallbacks", "repairs")
    for k in keep:
        if k in stored:
            setattr(res.report, k, stored[k])


def _reusable(path: Path, idx: int) -> bool:
    """Whether layer ``idx``'s stored file (a killed run's) can be reused: present and still the bytes recorded
    when it was written. A damaged or unverifiable one is removed with a warning, and the layer is recomputed."""
    if not path.exists():
        return False
    problem = stored_layer_problem(path)
    if problem is None:
        return True
    log.warning("layer %d: the stored %s is %s; recomputing the layer", idx, path.name, problem)
    remove_layer(path)
    return False


def _log_layer(report: LayerReport, n_layers: int, min_tokens: int) -> None:
    idx = report.layer
    for repair in report.repairs:
        log.warning("layer %d: numerical repair: %s", idx, repair)
    if report.rtn_fallbacks and min_tokens > 1:
        log.warning("layer %d: %d expert projections of experts routed fewer than %d calibration tokens "
                    "(quantize.min_tokens) fell back to RTN", idx, len(report.rtn_fallbacks), min_tokens)
    elif report.rtn_fallbacks:  # no statistics at all: the floor of one token holds whatever min_tokens says
        log.info("layer %d: %d expert projections of experts routed no calibration token were rounded to nearest "
                 "(RTN)", idx, len(report.rtn_fallbacks))
    log.info("layer %d: %d modules (%d experts), layer bits %.2f, worst rel err %.4f (%s), %.2fs%s",
             idx, report.n_modules, report.n_experts, report.mean_bits, report.worst_rel_error,
             report.worst_module, report.seconds, " (resumed)" if report.resumed else "",
             extra=step("quantize", idx + 1, n_layers))
