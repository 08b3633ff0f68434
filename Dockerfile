# syntax=docker/dockerfile:1
# Spillway: the proxy sidecar, the controller and the aggregator are one binary.
#   docker build -t spillway .
# The final image has no shell and no package manager: the binary, glibc, CA roots, a
# non-root user (65532). It needs no writable file system (mount the config read-only).

# Base images are pinned by digest (image:tag@sha256:...) for a release: scripts/check-pins
# fails the release workflow until they are. Renovate's pin and update PRs, or the manual
# step: docs/releasing.md.
FROM rust:1.95-slim-bookworm AS build
# The commit in spillway_build_info (the build context has no .git):
#   docker build --build-arg SPILLWAY_COMMIT=$(git rev-parse --short=12 HEAD) .
ARG SPILLWAY_COMMIT=unknown
ENV SPILLWAY_COMMIT=$SPILLWAY_COMMIT
WORKDIR /src
COPY . .
# Caches for the registry and the target dir keep rebuilds incremental (BuildKit); the target
# dir's is per platform, so that a multi-arch build's two stages do not share (and lock) one.
ARG TARGETPLATFORM
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=spillway-target-$TARGETPLATFORM \
    cargo build --release --locked --bin spillway \
    && cp target/release/spillway /spillway

# Pinned by digest as above (docs/releasing.md).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /spillway /usr/local/bin/spillway
USER 65532:65532
# 8080: the proxy; 7000/7001: controller and aggregator; 9901-9903: admin (metrics, probes, /ui).
EXPOSE 8080 7000 7001 9901 9902 9903
ENTRYPOINT ["/usr/local/bin/spillway"]
CMD ["proxy", "--config", "/etc/spillway/spillway.yaml"]
