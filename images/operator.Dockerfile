# The operator: the base install (kopf, kubernetes, pydantic), no torch. Non-root, and the
# chart runs it with a read-only root filesystem.
# The base is the engine's, pinned by digest the same way (see engine.Dockerfile); the two
# move together.
ARG BASE=python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY operator/ operator/
COPY engine/ engine/
RUN pip install --no-cache-dir --prefix=/install -c constraints.txt .

FROM ${BASE}
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["brook"]
CMD ["operator", "--all-namespaces"]
