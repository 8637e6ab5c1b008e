"""Imported last by the test ranks' fork server (`multiproc.PRELOAD`): everything the
server imported is long-lived in every rank forked from it, so it is moved out of the
garbage collector's generations here, once (`gc.freeze`, kept across `fork`). Each rank's
own full collections (`mcore.session.freeze_long_lived_objects`, the release of a layout)
then scan what the rank made, not the ~400k objects of torch and megatron-core again."""
import gc

gc.collect()
gc.freeze()
