/* Whether OpenACC regions built with the carried gcc 12 run on an NVIDIA GPU (bench/gpu.sh):
   the devices libgomp finds through its nvptx plugin, and where one region ran. libgomp
   falls back to the host without a word where it finds none; this says so. */
#include <openacc.h>
#include <stdio.h>

int main(void)
{
    int devices = acc_get_num_devices(acc_device_nvidia);
    int on_host = 1;
    long sum = 0;
#pragma acc parallel loop reduction(+:sum) copy(on_host)
    for (int i = 0; i < 1000; i++) {
        sum += i;
        if (i == 0)
            on_host = acc_on_device(acc_device_host);
    }
    printf("nvidia devices %d; the region ran on the %s; sum %ld (499500)\n", devices,
           on_host ? "host" : "device", sum);
    return sum == 499500 ? 0 : 1;
}
