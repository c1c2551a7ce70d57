"""What a runtime's wheels add to the GPU image: pip's resolution of it for the image's Python and platform, less what
the image has, with each wheel's size.

    python benchmarks/runtime_pins.py REPORT.json [--pins OUT.txt] [--skip NAME ...] [--part-size BYTES]

REPORT.json is ``pip install --dry-run --ignore-installed --report REPORT.json --only-binary=:all: --python-version
3.12 --implementation cp --platform manylinux_2_X_x86_64 ... --target DIR SPEC`` (``benchmarks/vllm_wheels.sh`` and
``benchmarks/sglang_wheels.sh`` run it). A resolved package is carried unless ``benchmarks/gpu-image.txt`` lists it at
a version every requirement on it in the resolution accepts; ``--skip`` names (fnmatch patterns) are left out as
optional. Prints one line a carried wheel (bytes from a HEAD request to its URL, the size pip would download), the
totals, and how many parts of ``--part-size`` bytes the wheels come to; ``--pins`` writes the carried set as
``name==version`` lines.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip's own copy, where packaging is not installed
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

IMAGE = Path(__file__).resolve().parent / "gpu-image.txt"
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_versions(path: Path = IMAGE) -> dict[str, Version]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[norm(name)] = Version(version)
    return out


def requirements_on(installs: list[dict]) -> dict[str, list[Requirement]]:
    """Every requirement the resolved packages place on each other, by the required package's name: markers for the
    image's Python and platform, an ``extra == X`` one only where some package asked for that package's extra X."""
    names = {norm(i["metadata"]["name"]) for i in installs}
    extras = {norm(i["metadata"]["name"]): set(i.get("requested_extras") or []) for i in installs}
    while True:
        out: dict[str, list[Requirement]] = {}
        for i in installs:
            own = extras[norm(i["metadata"]["name"])]
            for text in i["metadata"].get("requires_dist", []):
                req = Requirement(text)
                if norm(req.name) in names and (req.marker is None or any(
                        req.marker.evaluate({**ENV, "extra": e}) for e in own | {""})):
                    out.setdefault(norm(req.name), []).append(req)
        asked = {n: extras[n] | {e for r in rs for e in r.extras} for n, rs in out.items()}
        if all(asked[n] <= extras[n] for n in asked):
            return out
        for n, e in asked.items():
            extras[n] |= e


def carried(installs: list[dict], image: dict[str, Version], skip: list[str]) -> tuple[list[dict], list[dict]]:
    """(carried, left out as optional) of the resolution's packages."""
    reqs, keep, optional = requirements_on(installs), [], []
    for i in installs:
        name = norm(i["metadata"]["name"])
        have = image.get(name)
        if have is not None and all(r.specifier.contains(have, prereleases=True) for r in reqs.get(name, [])):
            continue
        (optional if any(fnmatch.fnmatch(name, s) for s in skip) else keep).append(i)
    return keep, optional


def size(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
        return int(r.headers["Content-Length"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("--pins", type=Path)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--part-size", type=int, default=55 * 2**20)
    args = ap.parse_args()
    installs = json.loads(args.report.read_text())["install"]
    keep, optional = carried(installs, image_versions(), args.skip)
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(lambda i: size(i["download_info"]["url"]), keep + optional))
    mib = 2**20
    rows = sorted(zip(keep + optional, sizes, strict=True), key=lambda r: -r[1])
    for i, n in rows:
        tag = " (optional, left out)" if i in optional else ""
        print(f"{n:>12,d}  {i['metadata']['name']}=={i['metadata']['version']}{tag}")
    total = sum(n for i, n in rows if i in keep)
    print(f"carried: {len(keep)} wheels, {total:,d} bytes ({total / mib:.1f} MiB) = "
          f"{math.ceil(total / args.part_size)} parts of {args.part_size / mib:.1f} MiB as wheels")
    left = sum(n for i, n in rows if i in optional)
    print(f"left out as optional: {len(optional)} wheels, {left:,d} bytes ({left / mib:.1f} MiB)")
    print(f"resolved: {len(installs)} packages; the image has {len(installs) - len(keep) - len(optional)} of them")
    if args.pins:
        args.pins.write_text("".join(f"{i['metadata']['name']}=={i['metadata']['version']}\n"
                                     for i in sorted(keep, key=lambda i: norm(i["metadata"]["name"]))))


if __name__ == "__main__":
    main()
