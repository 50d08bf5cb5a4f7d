# isthmus on a CUDA PyTorch base image: one image serves every site.
#   docker build -t isthmus .
#   docker run --gpus all isthmus isthmus site --config /etc/isthmus/job.toml --site site0
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# The wheel, its C extension (the lanes' receive path, inter/data/transport/wirecore.c)
# compiled here: the runtime image has no C compiler, and the image needs none.
FROM ${BASE} AS build
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY intra ./intra
COPY inter ./inter
COPY sim ./sim
COPY deploy ./deploy
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM ${BASE}
COPY --from=build /wheels /tmp/wheels
# The base image's torch satisfies torch>=2.11; nothing else pulls another build. The
# extension is optional to pip, not to the image: its import fails the build.
RUN pip install --no-cache-dir /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels \
 && python -c "import isthmus.inter.data.transport._wirecore"

# Coordinator (gRPC), Prometheus metrics, first lane port (one per rank from here).
EXPOSE 7070 9400 7100
ENTRYPOINT []
CMD ["isthmus", "--help"]
