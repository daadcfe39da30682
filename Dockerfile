# One image for every lsa service: the API, the bound worker and the GPU training worker.
#
#   docker build -t lsa:cpu .                                   # api, worker (CPU torch)
#   docker build -t lsa:cuda --build-arg TORCH_VARIANT=cu126 .  # worker-gpu (CUDA torch)
#
# The CUDA wheels carry their own CUDA runtime, so a slim Python base works for both: the GPU
# worker only needs the host's NVIDIA driver (NVIDIA Container Toolkit). docker-compose.yml
# builds both variants.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# cpu, or a CUDA tag of the PyTorch wheel index (cu126, cu128, ...).
ARG TORCH_VARIANT=cpu
ARG TORCH_SPEC="torch>=2.4"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LSA_ARTIFACT_DIR=/data/artifacts \
    LSA_SIGNING_KEY_PATH=/data/keys/signing_key.pem

WORKDIR /app

# torch first, from the wheel index of the chosen variant: a bare `pip install torch` would
# pick the default (multi-GB CUDA) build even for the CPU image.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# Dependencies before the sources, so code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p lsa_models api_schemas service \
    && touch lsa_models/__init__.py api_schemas/__init__.py service/__init__.py \
    && pip install ".[ptb]" \
    && pip uninstall -y lsa

COPY lsa_models ./lsa_models
COPY api_schemas ./api_schemas
COPY service ./service
COPY migrations ./migrations
# Editable: `lsa db upgrade` finds the top-level migrations/ next to the service package.
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 10001 lsa \
    && mkdir -p /data/artifacts /data/keys \
    && chown -R lsa:lsa /data

USER lsa
VOLUME ["/data"]
EXPOSE 8000

# Health checks live in docker-compose.yml: only the api container serves HTTP.
CMD ["lsa", "serve", "--host", "0.0.0.0", "--port", "8000"]
