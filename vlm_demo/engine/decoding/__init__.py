"""From a step's scores to a row's text: sampling, the stage grammar, detokenising and stops."""
