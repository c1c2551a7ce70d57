"""The world seam: the size-1 world, rank sharding and work splits, and real gloo process groups (3 ranks, spawned)
for the relay's global batch order, point-to-point delivery, the tensor exchange, writer errors and a dead rank."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from quant.errors import DistError, QuantError, RecipeError
from quant.parallel.relay import Relay
from quant.parallel.world import World, assign, even_ranges, init_world


def test_shard_covers_every_item_once_in_order():
    items = list(range(11))
    for size in (1, 2, 3, 4, 11, 13):
        parts = [World(rank=r, size=size).shard(items) for r in range(size)]
        assert [x for p in parts for x in p] == items
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_single_process_world_is_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    w = init_world("cpu")
    assert w == World() and w.is_writer and not w.distributed
    assert w.all_gather_object({"a": 1}) == [{"a": 1}]
    assert w.broadcast_object(3) == 3
    assert w.exchange_tensors({"x": torch.ones(2)})["x"].tolist() == [1.0, 1.0]
    assert w.on_writer(lambda: 5) == 5
    assert w.agree_stop() is None
    w.stop.set("SIGUSR1")
    assert w.agree_stop() == "SIGUSR1" and init_world("cpu").agree_stop() is None  # a fresh flag per world


def test_a_rank_without_a_gpu_of_its_own_is_one_clear_error(monkeypatch):
    """torchrun with more processes per node than visible GPUs: the rank whose LOCAL_RANK has no GPU says so and how
    to start the job, before any process group is joined (it used to fail in torch.cuda.set_device)."""
    from quant.errors import DistError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DistError, match=r"rank 1: LOCAL_RANK 1 has no GPU of its own \(1 visible.*--nproc-per-node 1"):
        init_world("cuda")


def test_processes_per_node_come_from_the_launcher_at_process_group_setup(monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE is read when the world is set up and travels with it; the page-locked read budget
    is a share of the host for that many processes, whatever the environment says later."""
    from quant.io.staging import pin_budget

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert init_world("cpu").local_size == 4 and World().local_size == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")  # read at the edge only: the budget follows the argument
    assert pin_budget(1) / pin_budget(4) == pytest.approx(4, rel=0.05)


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_bad_local_world_size_is_one_clear_error(monkeypatch, value):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(DistError, match=f"^LOCAL_WORLD_SIZE is '{value}': it must be a whole number of processes"):
        init_world("cpu")
@pytest.mark.parametrize("env,name", [
    ({"QUANT_DIST_TIMEOUT_S": "abc"}, "QUANT_DIST_TIMEOUT_S"), ({"QUANT_DIST_TIMEOUT_S": "nan"}, "QUANT_DIST_TIMEOUT_S"),
    ({"QUANT_DIST_TIMEOUT_S": "0"}, "QUANT_DIST_TIMEOUT_S"), ({"QUANT_DIST_TIMEOUT_S": "-5"}, "QUANT_DIST_TIMEOUT_S"),
    ({"QUANT_DIST_TIMEOUT_S": "inf"}, "QUANT_DIST_TIMEOUT_S"), ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"), ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
])
def test_launcher_variables_that_are_not_what_they_claim_are_one_dist_error(monkeypatch, env, name):
    """Checked before joining any group, on each rank: a bad timeout made every collective time out at once (each
    rank blaming another) or crashed; a bad WORLD_SIZE / RANK was a ValueError."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "QUANT_DIST_TIMEOUT_S"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(DistError, match=f"^{name}='") as e:
        init_world("cpu")
    assert "another rank" not in str(e.value)


def test_a_valid_timeout_is_the_worlds(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("QUANT_DIST_TIMEOUT_S", " 42.5 ")
    assert init_world("cpu").timeout_s == 42.5


def test_relay_consumes_at_once_in_a_world_of_one():
    seen = []
    relay = Relay(World())
    ch = relay.channel(lambda t: seen.append(int(t)))
    ch.put(torch.tensor(1))
    assert seen == [1]
    relay.flush()
    ch.close()
    ch.put(torch.tensor(2))
    assert seen == [1]


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_even_ranges_cover_every_item_in_contiguous_near_equal_parts(size):
    for n in (0, 1, 7, 128, 256):
        parts = even_ranges(n, size)
        assert len(parts) == size and [i for r in parts for i in r] == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_assign_puts_the_longest_item_on_the_least_loaded_rank():
    # Qwen3-30B-A3B-like: two equal expert halves, then o_proj (long) and q/k/v (short) on different ranks
    assert assign([6.0, 4.0], [10.0, 10.0]) == [0, 1]
    assert assign([1.0, 1.0, 1.0], [0.0, 5.0, 0.5]) == [0, 2, 0]
    assert assign([], [1.0]) == []
    loads = [3.0, 0.0, 1.0]
    owner = assign([2.0, 2.0, 1.0, 1.0], loads)
    final = [loads[r] + sum(c for c, o in zip([2.0, 2.0, 1.0, 1.0], owner, strict=True) if o == r) for r in range(3)]
    assert max(final) - min(final) <= 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, scenario: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size), RANK=str(rank),
                      LOCAL_RANK=str(rank), QUANT_DIST_TIMEOUT_S="60")
    try:
        world = init_world("cpu")
        out.put((rank, SCENARIOS[scenario](world)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, ("raised", type(e).__name__, str(e), traceback.format_exc()[-1500:])))


def _relay_order(world: World):
    """Each rank owns batches b % size == rank (4 steps of 3 ranks, the last one ragged); channel 0 goes to every
    rank, channel 1 to rank 1 only (point to point); consumers must see global batch order 0, 1, 2, ..."""
    n_batches, got_all, got_one = 10, [], []
    relay = Relay(world)
    ch_all = relay.channel(lambda t, s: got_all.append((int(t), s.tolist())))
    ch_one = relay.channel(lambda t: got_one.append(int(t)) if world.rank == 1 else None, {1})
    for step in range(-(-n_batches // world.size)):
        b = step * world.size + world.rank
        if b < n_batches:
            ch_all.put(torch.tensor(b), torch.arange(b % 4, dtype=torch.bfloat16))
            if b % 2 == 0:
                ch_one.put(torch.tensor(b))
        relay.flush()
    return got_all, got_one


def _local_relay(world: World):
    """A ``local`` relay: every rank consumes its own batches at once, and flushing moves nothing (it would hang or
    fail if ranks disagreed on collectives: rank 2 puts nothing at all)."""
    got = []
    relay = Relay(world, local=True)
    ch = relay.channel(lambda t: got.append(int(t)))
    for step in range(4):
        b = step * world.size + world.rank
        if world.rank != 2:
            ch.put(torch.tensor(b))
        relay.flush()
    return got


def _awq_split(world: World):
    """AWQ on layer 0 of a builtin model at 3 ranks: which experts each rank searched and quantized (before the
    codes exchange), and its range."""
    from transformers import AutoTokenizer

    from quant.calibration import build_calibration
    from quant.layerwise import Layerwise
    from quant.models import resolve_model
    from quant.plan.bitplan import plan_bits
    from quant.profile.profile import profile_routing
    from quant.quantize.algorithms import ALGORITHMS
    from quant.quantize.layer_job import LayerJob
    from quant.recipe import PlanSpec, QuantizeSpec

    src = resolve_model("builtin:qwen3-moe-tiny")
    calib = build_calibration(str(Path(__file__).parents[2] / "calibration" / "bundled.yaml"),
                              AutoTokenizer.from_pretrained(src.path), 8, 32, 0)
    lw = Layerwise(src, "float32", "cpu", 2, world=world)
    plan = plan_bits(profile_routing(src, calib, lw), src.modules, PlanSpec(group_size=32, symmetric=False), src.n_layers)
    hidden = lw.embed(calib.tokens)
    awq = ALGORITHMS["awq"]
    with lw.layer(0) as layer:
        job = LayerJob(src, 0, layer, plan.quantized_schemes(), QuantizeSpec(algorithm="awq"), world, awq.solve)
        awq.run_layer(job, lw, hidden)
        experts = sorted({int(n.split(".")[3]) for n in job.results.codes if ".experts." in n})
        r = job.ranges[world.rank]
        return experts, (r.start, r.stop), job.view.n_experts


def _exchange(world: World):
    mine = {f"r{world.rank}.q": torch.full((3, 2), world.rank, dtype=torch.int8),
            f"r{world.rank}.s": torch.full((3,), world.rank + 0.5, dtype=torch.bfloat16)}
    if world.rank == 2:
        mine = {}
    return {k: (v.dtype, v.tolist()) for k, v in world.exchange_tensors(mine).items()}


def _writer_error(world: World):
    def fail():
        raise RecipeError("bad recipe value")

    try:
        world.on_writer(fail)
    except QuantError as e:
        return type(e).__name__, str(e), getattr(e, "elsewhere", False)
    return None


def _peer_dies(world: World):
    if world.rank == 1:
        os._exit(3)  # a rank that dies without a word
    world.barrier()
    return "no error"


def _shared_read(world: World):
    """Layer 1 of a builtin model read in one share per rank and broadcast (the NCCL path, forced on gloo), then
    loaded: the experts are received into their stacked slots (traced live bytes over the read and the load, the
    stacked parameters' storage); in a compute dtype other than the stored one they are stacked (cast) after."""
    from quant.diag.memtrace import LiveBytes
    from quant.layerwise import LayerReader
    from quant.models import resolve_model
    from quant.models.layers import build_skeleton, load_layer, read_layer_tensors

    src = resolve_model("builtin:qwen3-moe-tiny")
    full = read_layer_tensors(src, 1)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        reader = LayerReader(src, world, torch.device("cpu"), dtype)
        reader.shared = True
        model = build_skeleton(src, dtype)
        with LiveBytes() as trace:
            got = reader.take(1)
            layer = load_layer(src, model, 1, "cpu", dtype, got)
        gate_key = next(k for k in got if k.endswith(".experts.0.gate_proj.weight"))
        ref = load_layer(src, build_skeleton(src, dtype), 1, "cpu", dtype, dict(full))
        out[str(dtype)] = (
            sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full),
            all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), ref.state_dict().values(), strict=True)),
            trace.peak.bytes / sum(t.numel() * t.element_size() for t in full.values()) / (dtype.itemsize / 2),
            layer.mlp.experts.gate_up_proj.data_ptr() == got[gate_key].data_ptr())
    shares = reader.shares(1)
    import tempfile

    from quant.models.fp8 import write_fp8_release

    fp8 = resolve_model(str(write_fp8_release(src, Path(tempfile.mkdtemp()) / "fp8", (32, 32))))
    reader = LayerReader(fp8, world, torch.device("cpu"), torch.bfloat16)
    reader.shared = True  # shares of the dense names, each rank dequantizing its own
    got, dense = reader.take(1), fp8.read_tensors([k for k in fp8.weight_map if k.startswith("model.layers.1.")])
    out["fp8"] = (sorted(got) == sorted(dense) and all(torch.equal(got[k], dense[k]) for k in dense), True, 0.0,
                  False)
    return out, [len(s) for s in shares], sorted(k for s in shares for k in s) == sorted(full)


def _fingerprint(world: World):
    """Node-local digest caches (a fresh QUANT_CACHE per rank): the model's shards are read whole by the writer
    alone, every rank ends with the writer's fingerprint."""
    import tempfile

    from quant.io import storage
    from quant.models import ModelSource, resolve_model
    from quant.run.pipeline import share_fingerprint

    path = resolve_model("builtin:qwen3-moe-tiny").path  # built in the session's shared cache
    os.environ["QUANT_CACHE"] = tempfile.mkdtemp(prefix=f"node{world.rank}-")
    hashed = []
    real = storage.sha256_uncached
    storage.sha256_uncached = lambda f: hashed.append(Path(f).name) or real(f)
    src = ModelSource(path)
    got = share_fingerprint(world, src)
    return got, src.fingerprint, hashed


SCENARIOS = {"fingerprint": _fingerprint, "relay": _relay_order, "local_relay": _local_relay, "awq_split": _awq_split, "shared_read": _shared_read, "exchange": _exchange, "writer_error": _writer_error, "peer_dies": _peer_dies}


def _spawn(scenario: str, size: int = 3) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, scenario, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(size if scenario != "peer_dies" else size - 1):
        rank, value = out.get(timeout=120)
        results[rank] = value
    for p in procs:
        p.join(timeout=60)
    return results


@pytest.fixture(scope="module")
def gloo_results():
    """One spawn per scenario, 3 gloo ranks each (a few seconds each)."""
    return {name: _spawn(name) for name in ("relay", "local_relay", "exchange", "writer_error", "peer_dies",
                                            "shared_read", "fingerprint", "awq_split")}


def test_the_model_is_hashed_by_the_writer_alone_and_its_fingerprint_reaches_every_rank(gloo_results):
    from quant.models import ModelSource, resolve_model

    res = gloo_results["fingerprint"]
    expect = ModelSource(resolve_model("builtin:qwen3-moe-tiny").path).fingerprint
    assert all(res[r][:2] == (expect, expect) for r in range(3)), res
    assert res[0][2] == ["model.safetensors"] and res[1][2] == res[2][2] == [], res


def test_relay_delivers_in_global_batch_order_to_consumers_only(gloo_results):
    res = gloo_results["relay"]
    for rank in range(3):
        got_all, got_one = res[rank]
        assert [b for b, _ in got_all] == list(range(10)), rank
        assert [s for _, s in got_all] == [[float(i) for i in range(b % 4)] for b in range(10)]
        assert got_one == ([0, 2, 4, 6, 8] if rank == 1 else [])


def test_a_local_relay_keeps_each_ranks_batches_on_that_rank(gloo_results):
    res = gloo_results["local_relay"]
    assert res == {0: [0, 3, 6, 9], 1: [1, 4, 7, 10], 2: []}, res


def test_awq_ranks_search_their_own_experts_only(gloo_results):
    """AWQ divides its searches: before the codes exchange each rank holds codes of its own experts only, and the
    ranks' ranges cover every expert once (the checkpoint equals one process's: tests/integration)."""
    res = gloo_results["awq_split"]
    assert all(not isinstance(res[r][0], str) for r in range(3)), res
    n = res[0][2]
    covered = []
    for rank in range(3):
        experts, (lo, hi), _ = res[rank]
        assert experts == list(range(lo, hi)), (rank, experts, lo, hi)
        covered += experts
    assert covered == list(range(n))


def test_exchange_tensors_gives_every_rank_the_union(gloo_results):
    res = gloo_results["exchange"]
    expect = {f"r{r}.q": (torch.int8, [[r, r]] * 3) for r in (0, 1)}
    expect |= {f"r{r}.s": (torch.bfloat16, [r + 0.5] * 3) for r in (0, 1)}
    assert all(res[r] == expect for r in range(3))


def test_writer_error_reaches_every_rank_and_only_the_writer_prints_it(gloo_results):
    res = gloo_results["writer_error"]
    assert res[0] == ("RecipeError", "bad recipe value", False)
    assert res[1] == res[2] == ("RecipeError", "bad recipe value", True)


def test_each_rank_reads_a_share_of_a_layer_and_every_rank_gets_all_of_it(gloo_results):
    for rank in range(3):
        by_dtype, sizes, covered = gloo_results["shared_read"][rank]
        assert covered and all(sizes), (rank, sizes)
        assert all(same and loaded for same, loaded, _, _ in by_dtype.values()), (rank, by_dtype)
        assert "fp8" in by_dtype  # an FP8 release (read dequantized) shared the same way


def test_shared_expert_tensors_are_received_into_the_stacked_layout(gloo_results):
    """A broadcast share's expert tensors land in their slots of the stacked experts: the load copies nothing, and
    the read and load allocate the layer once (1.0x traced; received tensors and then their stack: 1.53x here, the
    other ranks' two thirds received plus the stack). In another compute dtype they are stacked with a cast."""
    for rank in range(3):
        by_dtype = gloo_results["shared_read"][rank][0]
        _, _, ratio, in_place = by_dtype["torch.bfloat16"]
        assert in_place and ratio < 1.2, (rank, ratio)
        assert not by_dtype["torch.float32"][3], rank


def test_a_dead_peer_is_one_dist_error_not_a_hang(gloo_results):
    res = gloo_results["peer_dies"]
    for rank in (0, 2):
        assert res[rank][:2] == ("raised", DistError.__name__), res[rank]
        assert f"rank {rank} of 3: barrier failed" in res[rank][2] and "\n" not in res[rank][2]


def _leave_after_error(rank: int, size: int, port: int) -> None:
    """Rank 1 fails and leaves at once; rank 0 learns it inside a collective; both end as the CLI does after an
    error (close_world unclean, then exit_process)."""
    from quant.parallel.world import close_world, exit_process

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size), RANK=str(rank),
                      LOCAL_RANK=str(rank), QUANT_DIST_TIMEOUT_S="30")
    world = init_world("cpu")
    world.barrier()
    if rank == 0:
        try:
            world.barrier()  # the peer is gone or going: gloo reports the closed pair
            world.all_gather_object(rank)
        except Exception as e:  # noqa: BLE001 - any error ends the rank as the CLI does
            print(f"rank 0 saw {type(e).__name__}", flush=True)
    close_world(world, clean=False)
    print(f"rank {rank} leaving", flush=True)
    exit_process(1)


def _leave_cleanly(rank: int, size: int, port: int, out: str) -> None:
    """Both ranks finish, leave as the CLI does after a run (close_world clean, then exit_process(0)); an atexit
    handler records whether interpreter teardown (which destroys the group's C++ state) ran."""
    import atexit

    from quant.parallel.world import close_world, exit_process

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size), RANK=str(rank),
                      LOCAL_RANK=str(rank), QUANT_DIST_TIMEOUT_S="30")
    world = init_world("cpu")
    got = world.exchange_tensors({f"t{rank}": torch.full((64,), float(rank))})
    atexit.register(lambda: Path(out, f"teardown{rank}").write_text("ran"))
    close_world(world, clean=True)
    Path(out, f"sum{rank}").write_text(str(float(sum(t.sum() for t in got.values()))))
    exit_process(0)


def test_ranks_that_finish_exit_0_without_tearing_the_group_down(tmp_path):
    """A run that finished on every rank once ended with SIGABRT on the writer at interpreter exit ("terminate
    called without an active exception", a Slurm job FAILED in CI after its report was written): after the last
    barrier every rank ends through os._exit, so the group's C++ state is never destroyed. Three rounds."""
    ctx = mp.get_context("spawn")
    for i in range(3):
        out = tmp_path / str(i)
        out.mkdir()
        port = _free_port()
        procs = [ctx.Process(target=_leave_cleanly, args=(r, 2, port, str(out))) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
        assert [(out / f"sum{r}").read_text() for r in range(2)] == ["64.0", "64.0"]  # both got both tensors
        assert not list(out.glob("teardown*")), "interpreter teardown ran after the process group was left"


def test_ranks_that_leave_after_an_error_exit_with_their_status_not_an_abort():
    """After an error no rank tears its process group down (a peer may be mid-collective; gloo then aborted a rank
    with SIGABRT, exit -6, in CI): each exits with its own status, output flushed. Five rounds of 2 ranks."""
    ctx = mp.get_context("spawn")
    for _ in range(5):
        port = _free_port()
        procs = [ctx.Process(target=_leave_after_error, args=(r, 2, port)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [1, 1]


@pytest.mark.parametrize("env", [{"QUANT_DIST_TIMEOUT_S": "nan"}, {"WORLD_SIZE": "abc"}, {"LOCAL_WORLD_SIZE": "x"}])
def test_a_bad_job_wide_variable_is_one_error_line_for_the_job(monkeypatch, capsys, env):
    """Every rank of a torchrun job has the same QUANT_DIST_TIMEOUT_S and sizes: a bad one printed the same error
    line once per rank. Rank 0 prints it; the others exit with the same code and no line."""
    from quant.cli import cli_exit_code

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "QUANT_DIST_TIMEOUT_S"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    codes, lines = {}, {}
    for rank in ("0", "1", "3"):
        monkeypatch.setenv("RANK", rank)
        codes[rank] = cli_exit_code(["run", "recipes/mixed_int8_int4.yaml", "-o", "/nonexistent/never"])
        lines[rank] = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(set(codes.values())) == 1 and codes["0"] != 0
    assert len(lines["0"]) == 1 and next(iter(env)) in lines["0"][0]
    assert lines["1"] == lines["3"] == []
    with pytest.raises(DistError) as e:  # a rank's own variable stays that rank's line
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.delenv("QUANT_DIST_TIMEOUT_S", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        monkeypatch.setenv("LOCAL_RANK", "-1")
        init_world("cpu")
    assert not getattr(e.value, "elsewhere", False)
