# The engine: brook[engine] with the CPU build of torch (pass EXTRAS=npu and an Ascend
# base image for NPUs). It runs as user 1000 with a read-only root filesystem; HOME, /tmp and
# /dev/shm are emptyDirs in the pod.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
ARG EXTRAS=engine
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY operator/ operator/
COPY engine/ engine/
RUN pip install --no-cache-dir --prefix=/install -c constraints.txt ".[${EXTRAS}]"

FROM ${BASE}
COPY --from=build /install /usr/local
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["brook-engine"]
CMD ["serve", "--config", "/etc/brook/engine.yaml"]
