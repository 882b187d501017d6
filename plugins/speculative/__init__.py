"""Built-in speculative drafters (the ``Drafter`` contract lives in ``kvforge.spec_decode.drafter``)."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_drafters(register):
    register("ngram", "kvforge.plugins.speculative.ngram:NgramDrafter")
    register("draft_model", "kvforge.plugins.speculative.draft_model:DraftModelDrafter")
    register("eagle", "kvforge.plugins.speculative.eagle:EagleDrafter")
    register("eagle3", "kvforge.plugins.speculative.eagle:Eagle3Drafter")
