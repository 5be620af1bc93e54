#!/usr/bin/env bash
# One-shot check of shardstream's CUDA path on a machine with one NVIDIA GPU and no internet.
#
#     bash bench/gpu_check.sh          # from anywhere; it runs in the repository root
#
# Expects `python3` to hold a CUDA torch, numpy, pillow, msgpack, fsspec, tqdm, scikit-image, pytest
# and hypothesis. Packages it lacks travel as wheels in .whl/ (py3.12, manylinux x86_64; at present
# simplejpeg and pycocotools, which the checks import, and torchdata), installed here into /tmp/site,
# never into python3's own site-packages. The device step needs torchvision (nvJPEG) built for python3's
# torch: for machine C's torch 2.11+cu130, bring PyPI's 0.26.0 (it bundles CUDA 13's nvJPEG) with
#     pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --platform manylinux_2_28_x86_64 torchvision==0.26.0 -d .whl
# and, for nvImageCodec's figure beside it (optional), nvidia-nvimgcodec-cu13==0.9.0.20 and the
# nvidia-nvjpeg wheel its nvJPEG backend needs, the same way.
# Each step runs under `timeout`, and all of them within DEADLINE seconds, so the whole check ends in
# under 8 minutes. Everything printed also goes to $OUT/gpu_check.log (OUT defaults to /tmp/gpu_check).
# Exit status: 0 when every step passed, else 1.
#
# Steps:
#   install  the wheels of .whl/ into /tmp/site (skipped when there are none)
#   gpu      nvidia-smi -L
#   env      Python, torch and CUDA versions; the packages the checks import, and from where; stops
#            the check when torch sees no GPU (the CUDA test would only be skipped) or one is missing
#   pytest   the CUDA tests of tests/test_loader.py (batches on the device equal the CPU batches),
#            tests/test_device.py and tests/test_sa1b_batch.py (decode_device="cuda": the CPU path's
#            batches, masks bit for bit, images within a level)
#   device   bench/device_decode.py: decode_device="cuda" against the CPU path, 4 workers (issue 41)
#   bench    bench/cuda_pipeline.py at its documented settings (docs/performance.md, "GPU path")
#   resume   bench/gpu_resume.py, when that file exists

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1

OUT=${OUT:-/tmp/gpu_check}
SITE=/tmp/site
DEADLINE=$((SECONDS + 450))  # all steps together; the last ones get what is left
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout` (at most LIMIT_S seconds, and never past
# DEADLINE), then print "=== NAME: exit RC in T s", the line the summary collects.
step() {
    local name=$1 limit=$2 left rc start
    shift 2
    left=$((DEADLINE - SECONDS))
    if ((left < 15)); then
        echo "=== $name: not run, the check's time is used up"
        return 1
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== $name (limit ${limit} s): ${*%%$'\n'*}"  # (a command's first line)
    start=$SECONDS
    timeout -k 5 "$limit" "$@"
    rc=$?
    ((rc == 124 || rc == 137)) && echo "=== $name: TIMED OUT after ${limit} s"
    echo "=== $name: exit $rc in $((SECONDS - start)) s"
    return "$rc"
}

# The env step: versions, and the modules the checks import with where each comes from (the wheels'
# modules from /tmp/site). Exits 1 when torch sees no GPU or a module the checks need is missing;
# torchdata (StatefulDataLoader, for resume work; no step here imports it) is only reported, and so is
# torchvision (only the device step and its tests need it: they fail on their own without it).
ENV_CHECK='# versions; modules the checks import; a GPU
import importlib, importlib.metadata as md, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}")
names = ("numpy pillow msgpack fsspec tqdm scikit-image simplejpeg pycocotools torchdata torchvision "
         "pytest hypothesis lightning").split()
for name in names:
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
missing = []
for module in ("numpy", "PIL", "msgpack", "fsspec", "tqdm", "skimage.data", "simplejpeg", "pycocotools.mask",
               "pytest", "hypothesis", "pipeline", "shard_tools.pack", "torchdata.stateful_dataloader",
               "torchvision.io"):
    try:
        print(f"  import {module}: {importlib.import_module(module).__file__}")
    except Exception as exc:
        print(f"  import {module}: FAILED {type(exc).__name__}: {exc}")
        missing += [] if module.startswith(("torchdata", "torchvision")) else [module]
if not torch.cuda.is_available():
    sys.exit("torch sees no GPU: the CUDA checks cannot run")
print(f"GPU {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
if missing:
    sys.exit(f"cannot import: {missing}")
'

main() {
    echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), in $PWD," \
        "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    git status --short 2>/dev/null | sed 's/^/  changed: /'

    if compgen -G ".whl/*.whl" >/dev/null; then
        PIP_ROOT_USER_ACTION=ignore step install 90 python3 -m pip install -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
        ls .whl/
    else
        echo "=== install: no wheels in .whl/, nothing to install"
    fi
    export PYTHONPATH=$SITE:$PWD

    step gpu 30 nvidia-smi -L
    step env 60 python3 -c "$ENV_CHECK" || return

    # -rs: a skipped test says why (it skips only without CUDA, which env has ruled out); no test
    # selected exits 5, a failure here too.
    step pytest 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_loader.py tests/test_device.py \
        tests/test_sa1b_batch.py -k cuda

    # The device stage against the CPU path on the same data and workers (128 images of 1500x2250,
    # cached in .cache/bench-sa1b/128): samples/s, CPU ms per sample, the image part alone.
    step device 180 python3 bench/device_decode.py --images 128 --workers 4

    # 128 images of 1500x2250 built and packed, then 8 loader epochs and the copy/step overlap: about
    # a minute with 16 cores (estimated from 2). The settings of docs/performance.md: figures compare.
    step bench 180 python3 bench/cuda_pipeline.py --images 128 --workers 8

    if [ -f bench/gpu_resume.py ]; then
        step resume 120 python3 bench/gpu_resume.py
    else
        echo
        echo "=== resume: no bench/gpu_resume.py, skipped"
    fi
}

main 2>&1 | tee "$OUT/gpu_check.log"
# (main ran in a subshell of the pipeline: the steps' results are read back from the log)
{
    echo
    echo "=== summary"
    grep -E '^=== [a-z]+: (exit|not run|no |TIMED)' "$OUT/gpu_check.log" | sed 's/^=== /  /'
} | tee -a "$OUT/gpu_check.log"
if grep -qE '^=== [a-z]+: (exit [1-9]|not run|TIMED)' "$OUT/gpu_check.log"; then
    echo "gpu_check: FAILED" | tee -a "$OUT/gpu_check.log"
    exit 1
fi
echo "gpu_check: all passed" | tee -a "$OUT/gpu_check.log"
