# syntax=docker/dockerfile:1
# One image, both entrypoints: `agentrun operator` and `agentrun worker` (plus the CLI).
#   docker build -t REGISTRY/agentrun:0.1.0 .
# Your tools: build FROM this image and install your tool modules (README, "Install on Kubernetes").

ARG PYTHON_IMAGE=python:3.11-slim

# -- build: a virtualenv with agentrun and its dependencies (all wheels; no compiler needed) -------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/agentrun
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY operator ./operator
COPY worker ./worker
# src/agentrun/operator and src/agentrun/worker are symlinks to the two folders above.
# The extras: the OpenTelemetry SDK and OTLP exporter (OTEL_* environment alone turns traces on),
# and the SDK's Bedrock and Vertex clients (boto3, google-auth) for Agents whose spec.provider is
# bedrock or vertex; a worker imports those only when such a run comes.
RUN /opt/agentrun/bin/pip install --upgrade pip \
 && /opt/agentrun/bin/pip install ".[otel,bedrock,vertex]" \
 && /opt/agentrun/bin/agentrun --version

# -- final: the venv on a clean slim base, as a non-root user --------------------------------------
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/agentrun \
    PATH=/opt/agentrun/bin:$PATH \
    XDG_CACHE_HOME=/tmp/.cache
RUN groupadd --system --gid 10001 agentrun \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/agentrun --create-home \
      --shell /usr/sbin/nologin agentrun
COPY --from=build /opt/agentrun /opt/agentrun
# The chart runs with runAsUser 10001 and a read-only root filesystem (an emptyDir on /tmp).
USER 10001
WORKDIR /home/agentrun
# 8080: worker /healthz /readyz /metrics /drain and operator /healthz; 9090: operator /metrics.
EXPOSE 8080 9090
ENTRYPOINT ["agentrun"]
CMD ["--help"]
