"""Memory: the profile that runs each distinct block once, the model that predicts any plan's peak and activation bytes
from it, and the optimizer step's memory."""
