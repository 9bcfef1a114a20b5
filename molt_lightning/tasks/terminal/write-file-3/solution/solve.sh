#!/bin/bash
printf 'blue\n' > color.txt
