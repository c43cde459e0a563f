# The prewarm image: one image for every role (agent, planner, beat, gateway, Flower, runtime).
# The role is the `prewarm` subcommand given as the container's command.
#
# CPU build (docker-compose, laptops):   docker build -t prewarm:local .
# CUDA build (GPU nodes, the Helm chart): docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 -t prewarm:cuda .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PREWARM_RUNTIME_MODELS_DIR=/models \
    PREWARM_AGENT_STATE_DIR=/state

RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY prewarm ./prewarm
COPY workers ./workers
COPY forecasting ./forecasting
RUN pip install ".[flower]"

RUN useradd --create-home --uid 10001 prewarm \
    && mkdir -p /models /state \
    && chown prewarm /models /state
USER prewarm

EXPOSE 8080 8001 9400 5555
ENTRYPOINT ["prewarm"]
CMD ["--help"]
