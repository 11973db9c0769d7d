# giantmodel on NVIDIA's PyTorch image (CUDA, NCCL, cuDNN, apex and
# transformer-engine preinstalled). The image's torch is kept: the install
# below never replaces it.
ARG BASE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE}

WORKDIR /opt/giantmodel
COPY . .
# --no-build-isolation: build against the image's torch/CUDA toolchain
# instead of fetching another torch into an isolated build environment.
RUN pip install --no-cache-dir --no-build-isolation -e ".[hf]" \
    && giantmodel version

ENV GIANTMODEL_CACHE=/workspace/.cache/giantmodel
WORKDIR /workspace
ENTRYPOINT ["giantmodel"]
CMD ["--help"]
