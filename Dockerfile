# The trm image: the `trm` command (init-container sync, `trm agent` sidecar, CI promotions).
# Triton itself runs from NVIDIA's image (deploy/kubernetes/base/deployment.yaml), never from this one.
#   docker build -t registry.example.com/trm:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# uid 1000, as the Triton container's user: both write the pod's repository and the node cache.
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin trm

WORKDIR /src
COPY pyproject.toml README.md ./
COPY repo_manager ./repo_manager
RUN pip install . && cd / && rm -rf /src

USER 1000:1000
WORKDIR /home/trm
# Fails the build when the installed command cannot start.
RUN ["trm", "--version"]

ENTRYPOINT ["trm"]
CMD ["--help"]
