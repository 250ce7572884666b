# The deferral engine in a container: one image for the scheduler, workers and triggerers
# (the command picks which). Build: docker build -t deferral .
# Run:   docker run --rm -e DEFERRAL_DATABASE_URL=... -e DEFERRAL_FERNET_KEY=... \
#          -v /srv/dags:/dags deferral worker --dags /dags --metrics-port 9464
FROM python:3.11-slim

# DEFERRAL_METRICS_HOST: probes and Prometheus reach the metrics server from outside the
# container (the port stays off until --metrics-port or DEFERRAL_METRICS_PORT sets one).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEFERRAL_HOME=/var/lib/deferral \
    DEFERRAL_METRICS_HOST=0.0.0.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY triggers ./triggers
COPY operators ./operators
COPY benchmarks ./benchmarks
RUN pip install . \
    && rm -rf /src \
    && useradd --system --create-home --home-dir /var/lib/deferral --uid 10001 deferral

USER deferral
WORKDIR /var/lib/deferral
EXPOSE 9464
ENTRYPOINT ["deferral"]
CMD ["--help"]
