# syntax=docker/dockerfile:1
# swarm-peer for NVIDIA GPUs: a CUDA runtime base (the host needs only the driver and the NVIDIA container
# toolkit), Python 3.11 and a CUDA build of torch.
# Build from the repository root:  docker build -f docker/peer.Dockerfile -t swarm-peer:cuda .
# Run:  docker run --gpus all swarm-peer:cuda join --initial-peers MADDR --metrics-port 9101 --metrics-host 0.0.0.0
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# The torch build must match the base image's CUDA major version; change both together.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /opt/swarm
COPY pyproject.toml README.md ./
COPY swarm ./swarm
RUN pip install . && useradd --create-home --uid 1000 swarm && mkdir /data && chown swarm /data

USER swarm
VOLUME ["/data"]
EXPOSE 31337 31338 9101
ENTRYPOINT ["swarm-peer"]
CMD ["--help"]
