#!/bin/sh
# hydra's launcher for namespace nodes (tests/harness/netns.py): called as ssh would be
# (options, a host, the proxy's command line), it runs the command inside that host's
# namespaces instead of over ssh. $PYCOLL_NETNS_NODES lists "host pid" per node.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
pid=$(awk -v h="$host" '$1 == h { print $2 }' "$PYCOLL_NETNS_NODES")
if [ -z "$pid" ]; then
    echo "enter-node.sh: no namespace node $host in $PYCOLL_NETNS_NODES" >&2
    exit 1
fi
exec nsenter -t "$pid" -n -m -u -i -p -- sh -c "$*"
