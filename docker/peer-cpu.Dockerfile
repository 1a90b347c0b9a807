# syntax=docker/dockerfile:1
# swarm-peer for machines without a GPU, and for the bootstrap: Python 3.11 with the CPU build of torch.
# Build from the repository root:  docker build -f docker/peer-cpu.Dockerfile -t swarm-peer:cpu .
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the CPU index: otherwise pip resolves the multi-GB CUDA build from PyPI.
ARG TORCH_VERSION=2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

WORKDIR /opt/swarm
COPY pyproject.toml README.md ./
COPY swarm ./swarm
RUN pip install . && useradd --create-home --uid 1000 swarm && mkdir /data && chown swarm /data

USER swarm
# Checkpoints, the tokenizer cache and the bootstrap's identity key live on a volume so they survive the container.
VOLUME ["/data"]
# 31337: libp2p (pass --host-maddrs /ip4/0.0.0.0/tcp/31337); 31338: a peer's direct streams (--direct-port 31338);
# 9100: the bootstrap's metrics; 9101: a peer's metrics.
EXPOSE 31337 31338 9100 9101
ENTRYPOINT ["swarm-peer"]
CMD ["--help"]
