"""softrdma.socket: messages over RDMA with the manners of Python sockets, and a message
queue with one receiver and many senders (docs/socket.md).

    from softrdma import socket as rsock
    srv = rsock.create_server(("127.0.0.1", 7471))
    conn, peer = srv.accept()
    conn.send(conn.recv())

The protocol on the wire (:mod:`softrdma.socket.record`) is the seed project's:
MetaData records by SEND, large payloads pulled by RDMA READ and acknowledged, credits,
CLOSE; small messages travel inline in the record's SEND.
"""

from .conn import Message, Options
from .mq import ReceivedMessage, Receiver
from .record import ProtocolError
from .sock import create_connection, create_server, socket

__all__ = ["socket", "create_connection", "create_server", "Options", "Message",
           "ProtocolError", "Receiver", "ReceivedMessage"]
