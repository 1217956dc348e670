"""The server's flag defaults (server/cli_args.py's flags; build_app falls back to them for args that lack them).

Their own module so the app and the CLI both import them without importing each other."""
from __future__ import annotations

MAX_SAMPLES_PER_REQUEST = 64
# Prompts x samples per request: each sequence is queued, scheduled and decoded, so a 7 KB body of 1,000
# one-token prompts x n=64 would queue 64,000 of them ahead of everyone else.
MAX_SEQUENCES_PER_REQUEST = 1024
MAX_REQUEST_BODY_SIZE = 16 << 20
# A decode step takes milliseconds and a full prefill chunk well under a second on CPU; 30 s in one step is
# a stuck engine.
HEALTH_MAX_STALL_S = 30.0
# On SIGINT/SIGTERM open responses get this long to finish before the engine stops (and ends them with an
# error). Kubernetes users raise it to their longest stream (deploy/helm sets it below the pod's grace period).
SHUTDOWN_TIMEOUT_S = 5.0
