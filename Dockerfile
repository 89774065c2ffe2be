# Same steps as the README's `make serve`: a venv with the package installed, then `memproxy serve`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY storage ./storage
COPY policies ./policies
COPY config.yaml ./
RUN python -m venv /app/.venv && /app/.venv/bin/python -m pip install --quiet -e .
ENV MEMPROXY_CONFIG=/app/config.yaml
EXPOSE 8080
CMD ["/app/.venv/bin/memproxy", "serve", "--host", "0.0.0.0", "--port", "8080"]
