# syntax=docker/dockerfile:1
# The image cluster=k8s runs (cluster.k8s.image): this repository at /workspace/stratagem
# (cluster.k8s.workdir), installed editable with the Hugging Face and Kubernetes extras, torch first.
#
#   docker build -t <registry>/stratagem:<tag> .                       # CUDA (the default variant)
#   docker build -t <registry>/stratagem:<tag>-cpu --build-arg VARIANT=cpu .
#
# CUDA: NVIDIA's devel image, so DeepSpeed can build its ops (nvcc) on first use; the pods need
# the NVIDIA device plugin (cluster.k8s.gpu_resource). CPU: Ubuntu alone, torch's CPU wheel.
# tests/test_dockerfile.py lints this file and runs its commands' checks in CI's own shell.
ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

FROM ubuntu:24.04 AS base-cpu
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM base-${VARIANT}
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# python3-venv: Ubuntu's Python refuses system-wide pip; build-essential and libaio-dev: the
# DeepSpeed ops built on first use (CPU Adam, the shm all-reduce, NVMe offload's async_io).
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential libaio-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /workspace/stratagem
COPY . .
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && pip install -e ".[hf,k8s]"
# Fails the build if the configs do not compose or an entry point does not import.
RUN python train.py --cfg job > /dev/null && python plan.py model=gpt_nano > /dev/null
