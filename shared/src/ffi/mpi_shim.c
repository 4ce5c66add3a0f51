/* MPI_IN_PLACE is a macro whose value each MPI implementation chooses (OpenMPI: (void *) 1);
 * bindgen cannot see it, so it is read here, from the implementation's own mpi.h. */
#include <mpi.h>
void *ladder_mpi_in_place(void) { return MPI_IN_PLACE; }
