// TEMPORARY stub until branch `launch` merges.
