#!/usr/bin/env bash
# Run a command beside a docker daemon: the one that already answers (left running), else a dockerd started for the
# command and stopped after it, whatever the command's outcome (`make test-docker`). Exits with the command's status.
set -u
if docker info >/dev/null 2>&1; then
	exec "$@"
fi
if ! command -v dockerd >/dev/null; then
	echo "with_dockerd: no docker daemon answers and dockerd is not installed: apt-get install docker.io" >&2
	exit 2
fi
if [ "$(id -u)" != 0 ]; then
	echo "with_dockerd: no docker daemon answers; start one as root (dockerd), or run this as root" >&2
	exit 2
fi
state=$(mktemp -d "${TMPDIR:-/tmp}/mc-dockerd.XXXXXX")
dockerd --pidfile "$state/dockerd.pid" >"$state/dockerd.log" 2>&1 &
daemon=$!
stop() {
	kill -TERM "$daemon" 2>/dev/null
	for _ in $(seq 120); do  # it stops its containers and its containerd first
		kill -0 "$daemon" 2>/dev/null || break
		sleep 0.5
	done
	kill -KILL "$daemon" 2>/dev/null
	wait "$daemon" 2>/dev/null
	rm -rf "$state"
}
trap stop EXIT
for _ in $(seq 120); do
	docker info >/dev/null 2>&1 && break
	if ! kill -0 "$daemon" 2>/dev/null; then
		echo "with_dockerd: dockerd exited before it answered; its log ends:" >&2
		tail -5 "$state/dockerd.log" >&2
		exit 2
	fi
	sleep 0.5
done
"$@"
