# Prometheus for deploy/docker-compose.yml, built on the same Debian 12 base
# as the Pipemare image from Debian's own `prometheus` package (the build
# machines reach no image registry; on a machine that does, prom/prometheus
# works the same with deploy/prometheus/docker-compose.yml mounted). The
# configuration is mounted, not baked in. From the repository root:
#   docker build -f docker/prometheus.Dockerfile -t pipemare-prometheus .
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
VOLUME ["/prometheus"]
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=:9090"]
