"""Time: the model that predicts any plan's step time from each distinct block's timings under every mode
(taken during the memory profile, ``memory.block_times``) and the steps the search measured.
"""
