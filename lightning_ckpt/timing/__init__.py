"""Time: the model that predicts any plan's step time from each distinct block's timings and the measured steps."""
