# MatrixServe's two images, from one source tree (build from the repository root):
#   docker build --target matrixserve -t matrixserve/matrixserve:0.1.0 .   # operator + gateway
#   docker build --target engine-stub -t matrixserve/engine-stub:0.1.0 .   # engine stub + node emulator
# matrixserve: entrypoint `python -m`, the first argument names the module (`matrixserve` = the
# operator, `matrixserve.gateway` = the gateway), as the Helm chart runs it. engine-stub:
# `python -m enginestub` (the engine; `python -m enginestub.node` is the node emulator, in kind a
# DaemonSet in --mode advertise).
# BASE can be swapped for a locally imported base image (see `make images`).
ARG BASE=python:3.11.7-slim-bookworm
FROM ${BASE} AS runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Build-time only: a CA bundle for pip behind a TLS-inspecting proxy (see `make images`).
ARG PIP_CERT
WORKDIR /opt/matrixserve
COPY requirements/runtime.lock ./requirements/runtime.lock
# --break-system-packages: a Debian-based BASE marks its Python externally managed (PEP 668);
# this image is that Python's only user.
RUN python3 -m pip install --break-system-packages -r requirements/runtime.lock
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine-stub ./engine-stub
RUN python3 -m pip install --break-system-packages --no-deps . \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin matrixserve
USER 10001
HEALTHCHECK NONE

FROM runtime AS matrixserve
EXPOSE 8080 8081 8090 9443
ENTRYPOINT ["python3", "-m"]
CMD ["matrixserve"]

FROM runtime AS engine-stub
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "enginestub"]
