"""softrdma.qp: the sans-IO protocol core: QP state transitions, PSN arithmetic, and the
requester, completer and responder engines (rxe_req.c, rxe_comp.c, rxe_resp.c)."""
