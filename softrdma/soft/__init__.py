"""The soft backend: the device state the verbs objects and protocol engines share
(GID table, port, keys, QP numbers, counters) and, in later modules, its drivers."""
