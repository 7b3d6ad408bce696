"""The rules ``softrdma check`` enforces, and the record of one broken rule.

Every rule has a stable id (used by ``--rules`` and in the JSON output), a one-line
statement and a reference: a section of the IBTA specification (vol. 1, chapter 9 for the
RC/UC/UD transport, 7.8 for the ICRC, annex A17 for RoCEv2) or, where the spec leaves a
choice and rxe makes one, "rxe behaviour" with the kernel file that makes it. The rules are
listed once, here; docs/check.md renders the same table.

Section numbers are our reading of IBTA vol. 1 release 1.5. Those cross-checked against
public citations: 9.3.3.2, 9.7.4.1.5 (C9-88), 9.7.5.1.2, 9.7.5.2.8; the others are the
nearest section we could name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rule", "RULES", "Violation", "Sink"]


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    statement: str
    reference: str
    family: str  # the module that checks it, for the docs table


def _rules(*rows: tuple[str, str, str, str]) -> dict[str, Rule]:
    return {r[0]: Rule(*r) for r in rows}


#: rule id -> Rule, in the order docs/check.md lists them.
RULES: dict[str, Rule] = _rules(
    # frame: one packet at a time (check/frame.py)
    ("DECODE", "a UDP 4791 datagram is a well-formed RoCE packet: known opcode, headers, "
               "pad and ICRC fit", "IBTA 9.2, 9.3; rxe_recv.c rxe_rcv", "frame"),
    ("ICRC", "the ICRC matches the packet's invariant fields", "IBTA 7.8.1, annex A17; "
             "rxe_icrc.c", "frame"),
    ("FLUSH-ICRC", "a FLUSH carries the ICRC IBTA defines, not the one Linux rxe computes "
                   "(6.2 and later: the headers hashed a second time, because rxe_opcode.c "
                   "gives RC_FLUSH no payload offset); softrdma sends rxe's, to be accepted",
     "IBTA 7.8.1, annex A19; rxe_opcode.c, rxe_icrc.c", "frame"),
    ("UDP-DPORT", "RoCEv2 packets go to UDP port 4791", "IBTA annex A17 (RoCEv2 port)",
     "frame"),
    ("TVER", "BTH TVer is 0", "IBTA 9.2 (TVer); rxe_recv.c hdr_check", "frame"),
    ("RESERVED", "BTH reserved bits (resv6a, resv7), the DETH's reserved byte and the "
                 "AETH's top bit are sent as 0",
     "IBTA 9.2, 9.3.2, 9.3.5", "frame"),
    ("PAD", "PadCnt rounds the payload up to a multiple of 4 bytes",
     "IBTA 9.2 (PadCnt)", "frame"),
    ("NO-PAYLOAD", "opcodes without a payload (READ request, ACK, atomics) carry none",
     "IBTA 9.4 (packet formats); rxe_opcode.c", "frame"),
    # invariants: per QP (check/invariants.py)
    ("QP-TRANSPORT", "every packet to one QP uses that QP's transport (RC, UC or UD)",
     "IBTA 9.6 (header validation); rxe_recv.c check_type_state", "invariants"),
    ("PKEY", "the P_Key is the same on every packet of a QP (both directions of a connection)",
     "IBTA 9.6 (P_Key check); rxe_recv.c check_keys", "invariants"),
    ("SPORT", "a QP sends from one UDP source port", "IBTA annex A17 (source port is "
              "per-flow entropy); rxe_qp.c", "invariants"),
    ("SPORT-HASH", "the UDP source port is rxe's: in 0xC000-0xFFFF, the same in both "
                   "directions of a connection (a hash of the flow label, or of both QPNs), "
                   "the hash of the source QPN for UD", "rxe behaviour: rxe_qp.c "
                   "(rdma_get_udp_sport, rxe_qp_init)", "invariants"),
    # sequence: the requester's packets (check/sequence.py)
    ("OPSEQ", "a message is FIRST, MIDDLE..., LAST or a single ONLY; no other request "
              "starts before LAST", "IBTA 9.4 (packet sequences); rxe_resp.c check_op_seq",
     "sequence"),
    ("MTU-SIZE", "FIRST and MIDDLE packets carry exactly the path MTU, LAST 1..MTU, ONLY at "
                 "most MTU", "IBTA 9.4 (segmentation); rxe_resp.c check_length", "sequence"),
    ("WRITE-LEN", "an RDMA WRITE's payload adds up to the RETH DMA length",
     "IBTA 9.4.2, 9.3.3.2; rxe_resp.c check_length", "sequence"),
    ("PSN-SEQ", "each new request takes the next PSN (+1 mod 2^24; a READ takes one per "
                "response packet); a UC requester never goes back to a PSN it sent (a PSN "
                "ahead is a loss)", "IBTA 9.7.1, 9.4.3", "sequence"),
    ("RETRY-RANGE", "a go-back that starts at a SEND or WRITE packet, or at a READ whose "
                    "responses all came, starts at one the requester did not know to be "
                    "acknowledged (a NAK it acted on acknowledges what precedes it; the burst "
                    "may run past an ACK that arrives meanwhile, as rxe's does)",
     "IBTA 9.7.7 (requester retry, go-back-N); rxe_req.c req_retry", "sequence"),
    ("RETRY-SAME", "a retransmitted PSN carries the same request (opcode, headers, bytes; a "
                   "re-READ from the middle advances VA and shortens the length by whole MTUs)",
     "IBTA 9.7.7; rxe_req.c req_retry", "sequence"),
    ("ACKREQ-LAST", "the last packet of every RC request message sets AckReq",
     "rxe behaviour: rxe_req.c (END_MASK sets ackreq)", "sequence"),
    # responses: ACK / NAK (check/responses.py)
    ("AETH-SYNDROME", "the AETH syndrome is ACK, RNR NAK or a defined NAK code; READ "
                      "responses and atomic ACKs carry an ACK", "IBTA 9.3.5 (syndrome "
                      "encoding)", "responses"),
    ("ACK-PSN", "an ACK or NAK names a PSN the requester has sent (later requests at or "
                "below it prove it had not)", "IBTA 9.7.5.1", "responses"),
    ("MSN", "the MSN grows by the number of messages completed up to the acknowledged PSN "
            "(a READ counts when accepted)", "IBTA 9.7.5.1, C9-148; rxe_resp.c", "responses"),
    ("ACK-COVER", "every AckReq request is acknowledged in the end (coalescing allowed)",
     "IBTA 9.7.5.1.2 (coalesced acknowledges)", "responses"),
    ("ACK-CREDIT", "ACKs advertise unlimited credit (31)",
     "rxe behaviour: rxe_resp.c (AETH_ACK_UNLIMITED)", "responses"),
    ("NAK-ONCE", "a responder NAKs a PSN-sequence gap once, and the same PSN again only "
                 "after the requester went back (rxe: not until the expected PSN arrives)",
     "IBTA 9.7.5.2.1; rxe_resp.c check_psn (sent_psn_nak)", "responses"),
    ("NAK-RETRY", "after a PSN-sequence NAK or an RNR NAK the requester resends from the "
                  "NAK'd PSN, not after it (judged when the responder acknowledges a PSN the "
                  "capture never carried again)", "IBTA 9.7.5.2; rxe_comp.c", "responses"),
    ("NAK-FATAL", "after an invalid-request, remote-access or remote-operational NAK the "
                  "requester never resends the NAK'd request in answer to it (its QP goes to "
                  "the error state)",
     "IBTA 9.7.5.2; rxe_comp.c (error completion, QP to ERROR)", "responses"),
    ("RNR-WAIT", "after an RNR NAK the requester waits at least the NAK's timer before "
                 "resending", "IBTA 9.7.5.2.8; rxe_comp.c rnrnak_usec", "responses"),
    # READ responses (check/reads.py)
    ("READ-RESP-PSN", "a READ response PSN lies in the PSN range of a READ request (one at the "
                      "PSN of another request; one the capture has no request for at all is "
                      "an answer to a request it missed)", "IBTA 9.4.3", "reads"),
    ("READ-RESP-OPCODE", "a READ's responses are ONLY, or FIRST, MIDDLE..., LAST, by position "
                         "in its PSN range", "IBTA 9.4.3; rxe_resp.c read_reply", "reads"),
    ("READ-RESP-LEN", "each READ response carries min(MTU, what is left of the RETH "
                      "length)", "IBTA 9.4.3; rxe_resp.c read_reply", "reads"),
    # ATOMIC WRITE and FLUSH (check/a19.py)
    ("ATOMIC-WRITE-FORM", "an ATOMIC WRITE names 8 bytes at an 8-byte aligned VA in its "
                          "RETH and carries exactly those 8 bytes",
     "IBTA annex A19.4.2; rxe_resp.c check_rkey, rxe_mr.c rxe_mr_do_atomic_write", "a19"),
    ("FLUSH-FORM", "a FLUSH's FETH has its reserved bits 0, a placement type 1 (global), 2 "
                   "(persistent) or both, a selectivity level 0 (range) or 1 (MR)",
     "IBTA annex A19.3 (FETH); rxe_hdr.h feth_*", "a19"),
    ("A19-RESPONSE", "an ATOMIC WRITE or FLUSH is answered at its PSN by an RDMA READ "
                     "RESPONSE ONLY without data (a duplicate too, not executed again), not by "
                     "a plain ACK or an ATOMIC ACKNOWLEDGE",
     "IBTA annex A19 (oA19-14, oA19-15); rxe_resp.c send_read_response_ack", "a19"),
    # atomics (check/atomics.py)
    ("ATOMIC-ACK", "every atomic is answered by an ATOMIC ACKNOWLEDGE at its PSN, and only "
                   "atomics are", "IBTA 9.4.5, 9.3.6 (AtomicAckETH)", "atomics"),
    ("ATOMIC-REPLAY", "a duplicate atomic is answered with the original value of the first "
                      "execution, never executed again", "IBTA 9.7.4.1 (duplicate "
                      "requests); rxe_resp.c duplicate_request", "atomics"),
    # UD (check/ud.py)
    ("UD-QKEY", "every datagram to a UD QP carries that QP's Q_Key (QP1: 0x80010000)",
     "IBTA 9.6 (Q_Key check), C9-49", "ud"),
    ("UD-PSN", "a UD QP numbers its packets +1 each (a PSN ahead is a lost datagram, one "
               "going back to a datagram already sent a fault)", "rxe behaviour: rxe_req.c",
     "ud"),
)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: where (frame number, 1-based as tshark counts), which rule, what was
    expected against what was seen, and the conversation it belongs to."""

    frame: int
    rule: str
    message: str
    qp: str = ""

    @property
    def reference(self) -> str:
        return RULES[self.rule].reference

    def to_dict(self) -> dict[str, Any]:
        return {"frame": self.frame, "rule": self.rule, "reference": self.reference,
                "message": self.message, "qp": self.qp}


@dataclass
class Sink:
    """Where the rule modules put what they find. ``qp`` labels what follows."""

    violations: list[Violation] = field(default_factory=list)
    quiet: bool = False  # discard (the survey's pass reports nothing)

    def add(self, rule: str, frame: int, message: str, qp: str = "") -> None:
        assert rule in RULES, rule  # a typo in a rule id is a bug of the checker
        if not self.quiet:
            self.violations.append(Violation(frame, rule, message, qp))
