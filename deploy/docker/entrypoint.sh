#!/bin/sh
# `pagedserve serve` with flags from PAGEDSERVE_* environment variables; arguments given to the container are
# appended (later flags win in argparse, so they override the variables).
#
#   PAGEDSERVE_MODEL                model directory or .gguf (unset: the embedded SmolLM2)
#   PAGEDSERVE_SERVED_MODEL_NAME    name clients send (space-separated for aliases)
#   PAGEDSERVE_HOST / _PORT         listen address (image: 0.0.0.0:8000)
#   PAGEDSERVE_METRICS_PREFIX       vllm (image default) or pagedserve
#   PAGEDSERVE_TENSOR_PARALLEL_SIZE ranks (flag passed only when above 1)
#   PAGEDSERVE_MAX_MODEL_LEN, PAGEDSERVE_MAX_NUM_SEQS, PAGEDSERVE_KV_CACHE_MEMORY (bytes),
#   PAGEDSERVE_NUM_THREADS, PAGEDSERVE_DTYPE, PAGEDSERVE_SHUTDOWN_TIMEOUT (seconds)
#   PAGEDSERVE_EXTRA_ARGS           more flags, split on spaces
#   PAGEDSERVE_API_KEY              read by the server itself, so the key never appears in the process list
set -eu

flags=""  # the variables' flags, quoted for eval; they go in front of the container's arguments
add() {  # add FLAG VALUE: only when VALUE is non-empty
    if [ -n "$2" ]; then
        flags="$flags $1 $(quote "$2")"
    fi
}
quote() {  # single-quote for eval
    printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

add --model "${PAGEDSERVE_MODEL:-}"
add --host "${PAGEDSERVE_HOST:-0.0.0.0}"
add --port "${PAGEDSERVE_PORT:-8000}"
add --metrics-prefix "${PAGEDSERVE_METRICS_PREFIX:-vllm}"
add --max-model-len "${PAGEDSERVE_MAX_MODEL_LEN:-}"
add --max-num-seqs "${PAGEDSERVE_MAX_NUM_SEQS:-}"
add --kv-cache-memory "${PAGEDSERVE_KV_CACHE_MEMORY:-}"
add --num-threads "${PAGEDSERVE_NUM_THREADS:-}"
add --dtype "${PAGEDSERVE_DTYPE:-}"
add --shutdown-timeout "${PAGEDSERVE_SHUTDOWN_TIMEOUT:-}"
if [ "${PAGEDSERVE_TENSOR_PARALLEL_SIZE:-1}" != "1" ]; then
    add --tensor-parallel-size "$PAGEDSERVE_TENSOR_PARALLEL_SIZE"
fi
if [ -n "${PAGEDSERVE_SERVED_MODEL_NAME:-}" ]; then
    flags="$flags --served-model-name"
    for name in $PAGEDSERVE_SERVED_MODEL_NAME; do
        flags="$flags $(quote "$name")"
    done
fi
for arg in ${PAGEDSERVE_EXTRA_ARGS:-}; do
    flags="$flags $(quote "$arg")"
done

eval "set -- $flags \"\$@\""
exec pagedserve serve "$@"
