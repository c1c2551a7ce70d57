"""The layer-damage pass's two methods against each other: ``bounded`` (linear in depth, the default) and
``exact`` (every branch carried to the output, quadratic in depth).

For each model and calibration seed it runs ``recipes/mixed_vllm.yaml`` (one scheme per MoE layer by measured
damage, within the headline budget; served through quant's vLLM plugin) up to its plan stage twice, once per
method, through ``quant.run.pipeline``, and compares what a user gets: per scheme, the Spearman rank correlation
across MoE layers of the two damage vectors; whether the two plans are the same plan; the regret (the bounded
plan priced by the exact damage, over the exact plan, minus one); the profile stage's wall time (routing profile
and the pass). The exact pass's agreement with itself across calibration seeds is printed beside it: the
variation the bounded pass is judged against.

    python benchmarks/layer_damage.py                       # reference MoE and two builtin families, seeds 0-2
    python benchmarks/layer_damage.py --models builtin:reference-moe --seeds 0 --out /tmp/ld.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from itertools import combinations
from pathlib import Path

import torch

from quant.models.names import parse
from quant.recipe import load_recipe
from quant.run.pipeline import run

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "mixed_vllm.yaml"


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties broken by position; the damages are continuous)."""
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra @ rb / (ra.norm() * rb.norm()).clamp_min(1e-30)).item()


def one(model: str, seed: int, method: str, work: Path, carry: int = 1) -> dict:
    out = work / f"{model.replace(':', '_')}-{seed}-{method}"
    # served through quant's vLLM plugin: stock vLLM refuses Mixtral's compressed-tensors experts by name
    overrides = (f"calibration.seed={seed}", f"profile.layer_sensitivity.method={method}", "plan.target_runtime=vllm-quant")
    if method == "bounded":
        overrides += (f"profile.layer_sensitivity.carry_layers={carry}",)
    run(load_recipe(RECIPE, overrides=overrides, model=model), out, until="plan")
    manifest = json.loads((out / "manifest.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    return {"damage": json.loads((out / "profile.json").read_text())["layer_damage"],
            "modules": {n: (m["bits"], m["group_size"]) for n, m in plan["modules"].items()},
            "profile_s": manifest["stages"]["profile"]["wall_s"]}


def layer_schemes(modules: dict) -> list[str]:
    """The plan as one scheme per MoE layer (the first expert's gate of each layer)."""
    out = {}
    for name, (bits, group) in modules.items():
        n = parse(name)
        if n.block == "experts" and n.expert == 0 and n.leaf == "gate":
            out[n.layer] = f"w{bits}g{group}"
    return [out[k] for k in sorted(out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+",
                    default=["builtin:reference-moe", "builtin:mixtral-tiny", "builtin:deepseek-v3-tiny"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--carry", type=int, default=1, help="profile.layer_sensitivity.carry_layers of the bounded pass")
    ap.add_argument("--out", type=Path, help="write every number as JSON here")
    a = ap.parse_args()
    rows, record = [], {}
    with tempfile.TemporaryDirectory(prefix="quant-layer-damage-") as tmp:
        for model in a.models:
            exact_by_seed = {}
            for seed in a.seeds:
                got = {m: one(model, seed, m, Path(tmp), a.carry) for m in ("bounded", "exact")}
                exact_by_seed[seed] = got["exact"]["damage"]
                rho = {k: spearman(got["bounded"]["damage"][k], got["exact"]["damage"][k])
                       for k in got["exact"]["damage"]}
                same = got["bounded"]["modules"] == got["exact"]["modules"]
                # what the bounded plan costs, priced by the exact damage (the sum of its layers' single-layer KLs),
                # over what the exact plan costs: 0 when the plans are the same
                ex = got["exact"]["damage"]
                kl = {m: sum(ex[sch][i] for i, sch in enumerate(layer_schemes(g["modules"]))) for m, g in got.items()}
                regret = kl["bounded"] / kl["exact"] - 1
                record[f"{model} seed {seed}"] = {
                    "spearman": rho, "same_plan": same, "regret": regret, "predicted_kl_exact_damage": kl,
                    "plans": {m: layer_schemes(g["modules"]) for m, g in got.items()},
                    "profile_s": {m: g["profile_s"] for m, g in got.items()},
                    "damage": {m: g["damage"] for m, g in got.items()}}
                rows.append((model, seed, rho, same, regret, got["bounded"]["profile_s"], got["exact"]["profile_s"]))
                print(f"{model} seed {seed}: spearman {', '.join(f'{k} {v:.3f}' for k, v in rho.items())}; "
                      f"same plan {same}; bounded {layer_schemes(got['bounded']['modules'])}, exact "
                      f"{layer_schemes(got['exact']['modules'])}", flush=True)
            for s1, s2 in combinations(a.seeds, 2):  # the exact pass against itself on other calibration samples
                rho = {k: spearman(exact_by_seed[s1][k], exact_by_seed[s2][k]) for k in exact_by_seed[s1]}
                record[f"{model} exact seed {s1} vs {s2}"] = {"spearman": rho}
                print(f"{model} exact seed {s1} vs seed {s2}: {', '.join(f'{k} {v:.3f}' for k, v in rho.items())}")
    if a.out:
        a.out.write_text(json.dumps(record, indent=1))
    print(f"\n{'model':<26} {'seed':>4} {'min spearman':>12} {'same plan':>9} {'regret':>7} "
          f"{'profile s (bounded / exact)':>28}")
    for model, seed, rho, same, regret, tb, te in rows:
        print(f"{model:<26} {seed:>4} {min(rho.values()):>12.3f} {str(same):>9} {100 * regret:>6.2f}% "
              f"{tb:>13.1f} / {te:<13.1f}")


if __name__ == "__main__":
    main()
