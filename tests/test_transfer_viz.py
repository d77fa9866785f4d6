"""Chapter 13's transfer stepper (minikv/viz/transfer.py) is drawn from a live
DisaggregatedEngine's state: the worker's block ids from the transfer's header, the decode
pool's from its radix tree after the restore and its block tables after the step."""
import minikv
from minikv.engine.disagg import DisaggregatedEngine
from minikv.viz.transfer import (
    KINDS,
    TransferRecorder,
    TransferStepper,
    transfer_caption,
    transfer_info,
    transfer_stages,
)

from conftest import varied_model

MODEL = varied_model().double()


def test_the_stages_are_the_engines_state_and_the_captions_say_so():
    prompt = list(range(3, 36))  # 33 tokens: 32 travel, 4 blocks of 8
    with DisaggregatedEngine(MODEL, 24, page_size=8, lockstep=True, timeout=30) as engine:
        recorder = TransferRecorder(engine)
        engine.add(minikv.Request([9, 8, 7], 8), index=0)
        engine.add(minikv.Request(prompt, 3, arrival=2), index=1)
        while engine.has_work():
            engine.step()
        stages = transfer_stages(recorder, 1)
        moved = engine.transfers[1]
        here = [b for node, _ in engine.tree.match(prompt[:-1]) for b in node.blocks]
        recorder.close()
    assert [s.kind for s in stages] == list(KINDS)
    restored, admitted = stages[3], stages[4]
    assert restored.blocks_there == tuple(moved["blocks_there"]) and len(here) == 4
    assert restored.blocks_here == tuple(here) and restored.nbytes == moved["bytes"]
    assert admitted.reused == 32 and admitted.step == 2 and stages[0].step == 2
    assert admitted.here.tables[1][:4] == tuple(here)  # the table points at the restored blocks
    assert admitted.computed == 2  # request 0's decode row and request 1's last position
    said = [transfer_caption(s) for s in stages]
    assert "#" + str(here[0]) in said[3] and f"{moved['bytes']:,} bytes" in said[2]
    assert all(transfer_info(s).startswith("KV cache: ") for s in stages)
    stepper = TransferStepper(stages, title="t")
    assert stepper.n_steps == 6 and "1/6 sent" in stepper.caption.value
    stepper.go(3)
    assert "fresh blocks" in stepper.caption.value
    assert "image/png" in stepper._repr_mimebundle_()  # a static picture for the book
