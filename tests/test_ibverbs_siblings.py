"""One API, two backends as siblings: every verbs object is one verbs_api class holding
the implementation its context's backend gives (softrdma.verbs_api.base.Sibling). What only
the soft implementation has (the engine, its queues, key-table entries, the ring of
completions) is reachable on a soft object and absent -- not an AttributeError raised from
a missing engine -- on a hardware one.

The hardware implementations are made here without a device (``object.__new__``): what is
tested is what their classes and the API object expose, which needs no libibverbs.
"""

from __future__ import annotations

import pytest

from softrdma.ibverbs import completion, memory, queues
from softrdma.ibverbs.context import HwContext
from softrdma.pyverbs_compat import device as compat_device, qp as compat_qp
from softrdma.verbs_api import (
    AH, CQ, MR, MW, PD, QP, SRQ, CompChannel, Context, QPCap, QPInitAttr, SrqAttr,
    SrqInitAttr, add_device, remove_device,
)
from softrdma.verbs_api import enums as E

from .verbs_helpers import loopback_av

DEV_NAME = "softrdma-siblings"

# the members only the soft implementation has, per object (a hardware object must not
# show any of them, not even as a property that fails)
SOFT_ONLY = {
    QP: ("engine", "sq", "rq", "av", "_modify", "_make_send_wqe", "_fresh_attr",
         "_gather_inline", "_check_bind"),
    SRQ: ("rq", "take"),
    AH: ("av",),
    CQ: ("push", "error", "_wcs", "_armed"),
    CompChannel: ("notify", "wake", "_events"),
    MR: ("entry", "_entry", "_buffer"),
    MW: ("entry", "_entry"),
    Context: ("_events", "_on_fatal", "_on_async_event", "_check_port"),
}
# what only a hardware context has (the other hardware implementations read the first
# ones through the API context they are given)
HW_ONLY_CONTEXT = ("_addr", "_ops", "_objs", "_mrs", "_rxe", "num_comp_vectors",
                   "_attach", "adopt", "_gid_entry")
HW_IMPL = {Context: HwContext, QP: queues.HwQP, SRQ: queues.HwSRQ, AH: queues.HwAH, CQ: completion.HwCQ,
           CompChannel: completion.HwCompChannel, MR: memory.HwMR, MW: memory.HwMW,
           PD: memory.HwPD}


@pytest.fixture(scope="module")
def ctx():
    add_device("127.0.0.9", name=DEV_NAME, live=False)
    with Context(name=DEV_NAME) as c:
        yield c
    remove_device(DEV_NAME)


@pytest.fixture
def soft_objects(ctx):
    """One open soft object of each kind."""
    pd = PD(ctx)
    ch = CompChannel(ctx)
    cq = CQ(ctx, 8, None, ch)
    srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=4, max_sge=1)))
    qp = QP(pd, QPInitAttr(qp_type=E.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap()))
    objs = {Context: ctx, PD: pd, CompChannel: ch, CQ: cq, SRQ: srq, QP: qp,
            AH: AH(pd, loopback_av(ctx)), MR: MR(pd, 64, 0), MW: MW(pd, 2)}
    yield objs
    for o in (objs[AH], objs[MW], objs[MR], qp, srq, cq, ch, pd):
        o.close()


def _hw_object(api_cls: type) -> object:
    """An API object holding a hardware implementation, as the ibverbs backend makes it."""
    obj = object.__new__(api_cls)
    obj.impl = object.__new__(HW_IMPL[api_cls])
    return obj


@pytest.mark.parametrize("api_cls", list(SOFT_ONLY), ids=lambda c: c.__name__)
def test_soft_only_members_are_absent_on_hardware(api_cls, soft_objects):
    soft = soft_objects[api_cls]
    hw = _hw_object(api_cls)
    for name in SOFT_ONLY[api_cls]:
        # the list is real: the soft object or its implementation has each one
        assert hasattr(soft, name) or hasattr(soft.impl, name), name
        assert not hasattr(HW_IMPL[api_cls], name), name
        assert not hasattr(hw, name), name
        assert not hasattr(type(hw), name), name


@pytest.mark.parametrize("api_cls", list(HW_IMPL), ids=lambda c: c.__name__)
def test_one_class_on_both_backends(api_cls, soft_objects):
    soft, hw = soft_objects[api_cls], _hw_object(api_cls)
    assert type(soft) is type(hw) is api_cls
    assert not issubclass(HW_IMPL[api_cls], api_cls)  # a sibling of the soft one, not a child
    assert type(soft.impl).__name__ == "Soft" + api_cls.__name__
    # both implementations offer what the API object delegates to
    # (less what the soft engines read of it: qp/interfaces.py's CompletionSink/RecvSource)
    public = {n for n in vars(type(soft.impl)) if not n.startswith("_")} - {"extras", "closed"}
    missing = {n for n in public if not hasattr(HW_IMPL[api_cls], n)}
    assert missing <= set(type(soft.impl).extras), missing


def test_the_pyverbs_subclass_is_the_same_class_on_both(soft_objects):
    # pyverbs_compat's QP(CascadeClose, verbs_api.QP) needs no per-backend variant
    assert not any(k.__module__.startswith("softrdma.ibverbs") for k in compat_qp.QPEx.__mro__)
    hw = object.__new__(compat_qp.QP)
    hw.impl = object.__new__(queues.HwQP)
    assert not hasattr(hw, "engine") and not hasattr(hw, "sq")


def test_duplicate_requests(soft_objects):
    qp = soft_objects[QP]
    assert qp.duplicate_requests == 0
    qp.engine.resp.duplicates = 3  # what the responder counts when it re-answers
    assert qp.duplicate_requests == 3
    assert _hw_object(QP).duplicate_requests is None  # a device does not say


@pytest.mark.parametrize("api_cls", list(HW_IMPL), ids=lambda c: c.__name__)
def test_both_implementations_take_the_same_arguments(api_cls, soft_objects):
    """The API object makes either with the same call (``_create``, ``check_create``,
    ``prepare``): a hardware constructor that wants another argument would only fail on
    a device."""
    import inspect

    soft_cls, hw_cls = type(soft_objects[api_cls].impl), HW_IMPL[api_cls]
    for name in ("__init__", "check_create", "prepare"):
        if hasattr(soft_cls, name) or hasattr(hw_cls, name):
            s = inspect.signature(getattr(soft_cls, name)).parameters
            h = inspect.signature(getattr(hw_cls, name)).parameters
            assert len(s) == len(h), (name, list(s), list(h))


def test_the_context_holds_its_backends_implementation(ctx):
    from softrdma.verbs_api.device import SoftContext
    assert type(ctx) is Context and type(ctx.impl) is SoftContext
    assert ctx.backend is SoftContext.backend and ctx.device is ctx.impl.device
    assert not issubclass(HwContext, Context)  # no hardware Context class made at run time
    for name in HW_ONLY_CONTEXT:
        assert name in HwContext.extras or hasattr(HwContext, name), name
        assert not hasattr(ctx, name) and not hasattr(Context, name), name


def test_a_hardware_contexts_extras_are_reachable():
    hw = _hw_object(Context)
    hw.impl._addr, hw.impl._objs = 0x1000, {}
    assert hw._addr == 0x1000 and hw._objs == {}  # what HwPD, HwCQ... read
    assert not hasattr(hw, "_owned")  # not an extra: the implementation's own


def test_the_pyverbs_context_is_the_same_class_on_both():
    assert not any(k.__module__.startswith("softrdma.ibverbs")
                   for k in compat_device.Context.__mro__)
    hw = object.__new__(compat_device.Context)
    hw.impl = object.__new__(HwContext)
    for name in SOFT_ONLY[Context]:
        assert not hasattr(hw, name), name
    assert hw.num_comp_vectors == 1  # pyverbs' own answer, on either backend
