"""What realize ends an ONF with once its statements are final, for its tiled CUDA nests:
the block form checked (check_block_form), each nest's shared memory laid out
(lay_out_shared), then its barriers (insert_barriers) and its warp reductions
(insert_lane_reductions) put in: the printer prints them as they are."""
from moagen.onf.loops import ONF
from moagen.steps.gpu.barriers import insert_barriers
from moagen.steps.gpu.block_form import check_block_form
from moagen.steps.gpu.lane_reductions import insert_lane_reductions
from moagen.steps.gpu.shared_layout import lay_out_shared


def close_tiled(onf: ONF) -> ONF:
    check_block_form(onf)
    return insert_lane_reductions(insert_barriers(lay_out_shared(onf)))
