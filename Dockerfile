# syntax=docker/dockerfile:1
# plugvisor's images, from one Dockerfile:
#   docker build -t plugvisor:0.1.0 --build-arg VERSION=0.1.0 .                          # the release image
#   docker build -t plugvisor:0.1.0-emulators --target emulators --build-arg VERSION=0.1.0 .
#
# The release image (the last stage, built by default) is what a node runs: the agent, its plugins and
# DRA drivers (the `dra` extra: the *-dra overlays), and the hardware lab (`plugvisor lab`, which the lab
# overlay's DaemonSet runs). The `emulators` target adds the `emulators` extra on top of it, for the
# emulated kubelet and the demo in a container (`plugvisor kubelet`, `plugvisor demo`); no manifest uses
# it. bench/bench_image.py measures both.
ARG PYTHON_IMAGE=python:3.11-slim

# Stage `build`: the wheel, and everything the release image installs, laid out under /staging as it
# will be under / (pip's --root), every dependency pinned by constraints.txt (regenerate it as its header
# says). Shared libraries lose their debug sections here (uvloop's 13.6 MB are 1.9 MB without; PyYAML's
# 2.7 MB 0.4 MB): nothing loads them at run time, and the tools to strip them stay in this stage. So does
# the C compiler that builds the hardware lab's NVML stand-in (a lab's libnvidia-ml.so.1, docs/lab.md)
# into <data>/share/plugvisor/nvml, where `plugvisor lab create` finds it without a compiler: a lab the lab
# overlays' pod creates has NVML, as one created on a machine with cc has.
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends binutils gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .
COPY constraints.txt ./
RUN pip install --no-cache-dir --no-compile --root /staging --constraint constraints.txt \
        "$(echo /wheels/plugvisor-*.whl)[dra]" \
    && find /staging -name '*.so' -exec strip --strip-debug {} + \
    && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="/staging$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
       XDG_CACHE_HOME="/staging$(python -c 'import sysconfig; print(sysconfig.get_path("data"))')/share" \
       python -c 'from plugvisor.emulators.lab import nvml; raise SystemExit(nvml.build() is None)'

FROM ${PYTHON_IMAGE} AS release
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="plugvisor" \
      org.opencontainers.image.description="Kubernetes device plugins in Python: node agent, plugins and hardware lab" \
      org.opencontainers.image.source="https://github.com/plugvisor/plugvisor" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /staging/ /
# The bytecode, compiled once here, at the paths it runs from: with PYTHONDONTWRITEBYTECODE every process
# would otherwise compile each module it imports at every start (about a second more per plugin here).
RUN python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    && plugvisor --help > /dev/null
# Root at run time, with every capability dropped by the manifests (deploy/kubernetes): the kubelet's
# device-plugins directory belongs to root (0750) and the plugins create their sockets in it. Only the
# lab's init container (overlays/lab) keeps one capability, CAP_MKNOD, for `plugvisor lab create --mknod`.
USER 0:0
WORKDIR /
ENTRYPOINT ["plugvisor"]
CMD ["--help"]

FROM release AS emulators
LABEL org.opencontainers.image.description="Kubernetes device plugins in Python: node agent, plugins, hardware lab, emulated kubelet and demo"
# The same wheel again, with its `emulators` extra: pip keeps what the release stage has.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/src/constraints.txt,target=/tmp/constraints.txt \
    pip install --no-cache-dir --constraint /tmp/constraints.txt "$(echo /wheels/plugvisor-*.whl)[emulators]" \
    && plugvisor kubelet --help > /dev/null

# The default target: the release image.
FROM release
