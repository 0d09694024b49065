# syntax=docker/dockerfile:1
# The plugvisor release image: one entry point, the `plugvisor` command (agent, plugins, lab, kubelet).
#   docker build -t plugvisor:0.1.0 --build-arg VERSION=0.1.0 .
#
# Stage 1 builds the wheel from the source tree; stage 2 installs only that wheel, with every dependency
# pinned by constraints.txt (regenerate it as its header says), onto a slim Python base.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="plugvisor" \
      org.opencontainers.image.description="Kubernetes device plugins in Python: node agent, plugins, emulated kubelet and hardware lab" \
      org.opencontainers.image.source="https://github.com/plugvisor/plugvisor" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY constraints.txt /tmp/constraints.txt
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --constraint /tmp/constraints.txt /wheels/plugvisor-*.whl \
    && rm /tmp/constraints.txt \
    && plugvisor --help > /dev/null
# Root at run time, with every capability dropped by the manifests (deploy/kubernetes): the kubelet's
# device-plugins directory belongs to root (0750) and the plugins create their sockets in it. Only the
# lab's init container (overlays/lab) keeps one capability, CAP_MKNOD, for `plugvisor lab create --mknod`.
USER 0:0
WORKDIR /
ENTRYPOINT ["plugvisor"]
CMD ["--help"]
