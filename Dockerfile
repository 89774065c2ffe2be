# Same steps as the README's `make serve`: a venv with the package installed, then `memproxy serve`.
# The shipped config.yaml (echo upstream, `demo-key`) is for trying it out: mount your own at
# /app/config.yaml, or point MEMPROXY_CONFIG elsewhere. Relative paths in it (the SQLite file,
# the spill) land in /data, the working directory: keep it on a volume.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY storage ./storage
COPY policies ./policies
COPY config.yaml ./
RUN python -m venv /app/.venv && /app/.venv/bin/python -m pip install --quiet -e . \
    && groupadd --system --gid 10001 memproxy \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --create-home memproxy
ENV MEMPROXY_CONFIG=/app/config.yaml
# Numeric, so that Kubernetes' runAsNonRoot can check it. A host directory mounted at /data
# must be writable by uid 10001 (chown 10001:10001 it).
USER 10001:10001
WORKDIR /data
VOLUME /data
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD ["/app/.venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=2)"]
CMD ["/app/.venv/bin/memproxy", "serve", "--host", "0.0.0.0", "--port", "8080"]
