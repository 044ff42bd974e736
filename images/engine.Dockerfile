# The engine: brook[engine] with the CPU build of torch (pass EXTRAS=npu and an Ascend
# base image for NPUs). It runs as user 1000 with a read-only root filesystem; HOME, /tmp and
# /dev/shm are emptyDirs in the pod.
# The base is pinned by digest: a tag moves, so the same Dockerfile would build a different
# image next week. This digest is the multi-platform index of python:3.11-slim (Python 3.11.15
# on Debian trixie, built 2026-08-05) as docker-library/repo-info records it. To move it:
# `docker buildx imagetools inspect python:3.11-slim` prints the current one.
ARG BASE=python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff
FROM ${BASE} AS build
ARG EXTRAS=engine
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY operator/ operator/
COPY engine/ engine/
RUN pip install --no-cache-dir --prefix=/install -c constraints.txt ".[${EXTRAS}]"
# The CPU kernels (decode attention, fused layer steps) for a baseline CPU (x86-64-v3 / armv8-a): the runtime
# image has no compiler to build it at first use. Where this fails the engine runs the
# portable path and says so in its log.
RUN (command -v cc || (command -v apt-get && apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev)) >/dev/null \
    && PYTHONPATH="$(echo /install/lib/python3*/site-packages)" \
        python -m brook_engine.layers.cpu_kernels --prebuild \
    || echo "CPU kernels not prebuilt: the portable paths will run"

FROM ${BASE}
COPY --from=build /install /usr/local
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["brook-engine"]
CMD ["serve", "--config", "/etc/brook/engine.yaml"]
