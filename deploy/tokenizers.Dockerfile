# Bakes tokenizer files into a kvrouter (or kvsim) image, for clusters where mounting them is
# awkward. The build context is a directory of tokenizer directories (one per model, each with
# tokenizer.json and, for chat models, tokenizer_config.json), e.g. what `make tokenizers` fetches:
#
#   docker build -f deploy/tokenizers.Dockerfile --build-arg BASE_IMAGE=kvrouter:latest \
#     -t kvrouter-with-tokenizers .cache/tokenizers
#
# The files land in /var/lib/kvrouter/tokenizers/<model>/, where the manifests' configs look
# (models[].tokenizer). Tokenizer files are never committed to this repository.
ARG BASE_IMAGE=kvrouter:latest
FROM ${BASE_IMAGE}
COPY . /var/lib/kvrouter/tokenizers/
