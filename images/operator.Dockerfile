# The operator: the base install (kopf, kubernetes, pydantic), no torch. Non-root, and the
# chart runs it with a read-only root filesystem.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY operator/ operator/
COPY engine/ engine/
RUN pip install --no-cache-dir --prefix=/install -c constraints.txt .

FROM python:3.11-slim
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["brook"]
CMD ["operator", "--all-namespaces"]
