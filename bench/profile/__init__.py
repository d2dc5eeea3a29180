"""Where does a step's time or memory go? One step, one kernel or one setting measured apart."""
