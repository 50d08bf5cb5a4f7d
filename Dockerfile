# isthmus on a CUDA PyTorch base image: one image serves every site.
#   docker build -t isthmus .
#   docker run --gpus all isthmus isthmus site --config /etc/isthmus/job.toml --site site0
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE}

WORKDIR /opt/isthmus
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY intra ./intra
COPY inter ./inter
COPY sim ./sim
COPY deploy ./deploy
# The base image's torch satisfies torch>=2.11; nothing else pulls another build.
RUN pip install --no-cache-dir .

# Coordinator (gRPC), Prometheus metrics, first lane port (one per rank from here).
EXPOSE 7070 9400 7100
ENTRYPOINT []
CMD ["isthmus", "--help"]
