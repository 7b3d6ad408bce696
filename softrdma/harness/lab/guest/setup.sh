#!/bin/sh
# The first command of a lab guest (virtme-ng --exec): setup.sh IP DIR PYTHON PORT
# Address the NIC, add the rxe device rxe0 on it, record the NIC's name in DIR/nic.IP for
# the host (tc netem), then become the command agent (DIR/agent.py) on IP:PORT.
IP=$1; DIR=$2; PY=$3; PORT=$4
NIC=$(ls /sys/class/net | grep -v '^lo$' | head -1)
ip link set lo up
ip addr add "$IP/24" dev "$NIC"
ip link set "$NIC" up
modprobe rdma_rxe
modprobe sch_netem 2>/dev/null
rdma link add rxe0 type rxe netdev "$NIC"
echo "$NIC" > "$DIR/nic.$IP"
exec "$PY" "$DIR/agent.py" "$IP" "$PORT"
