"""A layout's counted terms in closed form, one node's layouts with their terms, the calibrations they give, and the
layout change proposed for the tuned job. Pure functions of plain numbers and results."""
