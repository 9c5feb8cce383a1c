"""What a CUDA tiled kernel's printer takes (moagen.targets.cuda.tiled), checked once the
mapping steps have run: every statement inside a nest's grid runs on the block's threads
(inside a thread loop, or a block's copy), and every loop there is uniform across the
block's threads (its bounds read no thread's row or column), so that each thread reaches
every barrier and warp shuffle the printer puts in it. BlockTiles and ThreadTiles check
what they can as they run; these properties hold only of the finished mapping."""
from moagen.errors import ScheduleError
from moagen.onf.loops import Loop, ONF, is_block_copy, is_grid, is_thread_loop, walk


def check_block_form(onf: ONF):
    """ScheduleError naming the nest and the statement where a tiled nest breaks the
    above."""
    for nest in onf.nests:
        if any(map(is_grid, walk(nest.body))):
            _check(nest.label, nest.body, threads=(), in_grid=False)


def _check(label, stmts, threads, in_grid):
    for s in stmts:
        if not isinstance(s, Loop):
            if in_grid and not threads:
                raise ScheduleError(f"nest {label}: {s} is inside the grid and outside every "
                                    "thread loop: map its loops with ThreadTiles")
            continue
        bound_by = (s.start.free_symbols | s.stop.free_symbols) & set(threads)
        if is_block_copy(s):
            if bound_by:
                raise ScheduleError(f"nest {label}: a block's copy over {s.var} has bounds "
                                    f"that read the thread loops' {sorted(map(str, bound_by))}")
            continue  # its threads are the whole block's
        if bound_by and not is_thread_loop(s):
            raise ScheduleError(f"nest {label}: the loop over {s.var} has bounds that read the "
                                f"thread loops' {sorted(map(str, bound_by))}: its threads would "
                                "not all reach a barrier inside")
        inner = threads + ((s.var,) if is_thread_loop(s) else ())
        _check(label, s.body, inner, in_grid or is_grid(s))
