# The image of the `deploy` and `worker` services in infra/compose.yaml (and of Kubernetes flow-run pods):
# the project, its two virtual environments (vLLM has its own: docs/architecture.md s7) and bubblewrap.
# Not built here (no registry is reachable); `make setup` does the same steps on a machine.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap debootstrap git make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN make venv vllm-venv && .venv/bin/pip install --no-deps -e .
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1
CMD ["prefect", "worker", "start", "--pool", "rlvr", "--type", "process", "--limit", "1"]
